"""Whatever one request's SamplingParams hold, it fails alone.

Hypothesis draws SamplingParams keyword arguments from the whole typed space (NaN, +-inf, huge and
tiny floats, negative numbers, floats where ints belong (integral or not), bools, wrong types, huge
lists, every field) and runs them in one batch with good greedy requests on the embedded model,
synchronously and with asynchronous scheduling. Each drawn request is either refused when it is made
or added (ValueError or TypeError: the door), or, once accepted, ends on its own: with a normal
finish reason or with "error" carrying a SamplingError. Nothing raises out of a step, every good
request equals its solo greedy run, every request gets a final output, the pool passes its integrity
check after every step and holds no used block afterwards. The test does not depend on where the door
stands: whatever it lets through must fail alone."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagednb import LLM, RequestOutputKind, SamplingParams
from pagednb.request import SamplingError

GOOD = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
GOOD_PROMPTS = [[5, 17, 99, 3, 250, 8], [700, 12, 12, 40, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
FIELDS = ["temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
          "include_stop_str_in_output", "logprobs", "prompt_logprobs", "skip_special_tokens", "truncate_prompt_tokens",
          "output_kind"]

NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-4.0, max_value=4.0),
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.integers(min_value=-3, max_value=40),
    st.sampled_from([0, 1, -1, 0.0, 1.0, -0.0, 1e-40, 1e-300, 5e-324, 1e-5, 1e300, 3.5e38, 2.5, 40.0, 1e6,
                     True, False, math.nan, math.inf, -math.inf]),
)
WRONG_TYPES = st.sampled_from([None, "1", "", b"1", [1], (2,), {"a": 1}, 1 + 2j, RequestOutputKind.DELTA, object()])
LISTS = st.one_of(
    st.lists(st.one_of(st.integers(min_value=-5, max_value=2 ** 40), st.text(max_size=3), NUMBERS), max_size=6),
    st.builds(lambda n, base: list(range(base, base + n)), st.integers(0, 4000), st.integers(-2, 2000)),
    st.builds(lambda n: [str(i) for i in range(n)], st.integers(0, 500)),
    st.text(max_size=4),
)
VALUES = st.one_of(NUMBERS, NUMBERS, WRONG_TYPES, LISTS, st.sampled_from(list(RequestOutputKind)))
WILD = st.dictionaries(st.sampled_from(FIELDS), VALUES, min_size=1, max_size=5)
# Values a door may well let through that push the sampler to its edges: overflowing penalties, top_p
# that underflows float32, counts past the vocabulary (1138 tokens), stop ids outside it or covering it
# whole while min_tokens bans them, temperatures at the greedy threshold or huge.
EDGES = {
    "temperature": st.one_of(st.floats(0, 1e6), st.sampled_from([1e-5, 1.0001e-5, 1e-4, 1e30, 3e38])),
    "top_p": st.one_of(st.floats(1e-45, 1.0), st.sampled_from([1e-300, 1e-38, 5e-324, 1.0])),
    "top_k": st.one_of(st.integers(-1, 3000), st.sampled_from([40.0, 1.0, 2.0 ** 40, 10 ** 12])),
    "min_p": st.one_of(st.floats(0.0, 1.0), st.sampled_from([1.0, 1 - 1e-7])),
    "repetition_penalty": st.one_of(st.floats(1e-6, 1e6), st.sampled_from([1e-40, 1e-6, 1e6, 1e40])),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "logprobs": st.one_of(st.integers(-1, 5000), st.sampled_from([0.0, 20.0, 1138, 1139, 10 ** 9])),
    "prompt_logprobs": st.one_of(st.integers(-1, 5000), st.sampled_from([-1, 0.0, 1138, 1139])),
    "min_tokens": st.integers(0, 4),
    "stop_token_ids": st.one_of(st.lists(st.integers(0, 10 ** 7), max_size=4),
                                st.sampled_from([list(range(1138)), list(range(2000)), [10 ** 6]])),
    "seed": st.integers(0, 2 ** 64 - 1),
    "max_tokens": st.integers(1, 8),
}
EDGY = st.fixed_dictionaries({}, optional=EDGES)
BAD_KWARGS = st.one_of(WILD, EDGY)
PROMPTS = st.lists(st.integers(0, 1000), min_size=1, max_size=20)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request):
    engine = LLM(max_model_len=64, async_scheduling=request.param)  # short: a request's length is bounded
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def solo(llm):
    return [llm.generate({"prompt_token_ids": p}, GOOD, use_tqdm=False)[0].outputs[0].token_ids
            for p in GOOD_PROMPTS]


def add_drawn(engine, request_id: str, prompt: list[int], kwargs: dict) -> bool:
    """Makes and adds the drawn request; False when the door refuses it, with ValueError or TypeError."""
    kwargs = {"max_tokens": 4, **kwargs}  # short unless the draw says otherwise
    try:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, SamplingParams(**kwargs))
    except (ValueError, TypeError):
        return False
    return True


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(drawn=st.lists(st.tuples(BAD_KWARGS, PROMPTS), min_size=1, max_size=3), good_first=st.booleans())
@example(drawn=[(dict(top_k=40.0), [1, 2]), (dict(logprobs=1139), [3]), (dict(logprobs=2.5), [4])], good_first=True)
@example(drawn=[(dict(top_p=1e-300), [5]), (dict(stop_token_ids=[10 ** 6], min_tokens=3), [6, 7])], good_first=False)
@example(drawn=[(dict(repetition_penalty=1e-40, temperature=1.0), [8, 9, 8, 9])], good_first=True)
@example(drawn=[(dict(stop_token_ids=list(range(1138)), min_tokens=2), [10]), (dict(logprobs=True), [11])],
         good_first=True)
def test_whatever_a_request_asks_it_fails_alone(llm, solo, drawn, good_first):
    engine = llm.engine
    good_ids = [f"good{i}" for i in range(len(GOOD_PROMPTS))]

    def add_good():
        for request_id, prompt in zip(good_ids, GOOD_PROMPTS):
            engine.add_request(request_id, {"prompt_token_ids": prompt}, GOOD)
    if good_first:
        add_good()
    accepted = [f"drawn{i}" for i, (kwargs, prompt) in enumerate(drawn)
                if add_drawn(engine, f"drawn{i}", prompt, kwargs)]
    if not good_first:
        add_good()

    finals = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():  # a step that raises fails the test: the engine must never die
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()
    assert set(finals) == set(good_ids) | set(accepted)  # nothing submitted is lost
    for request_id, expected in zip(good_ids, solo):
        out = finals[request_id]
        assert out.error is None and out.outputs[0].finish_reason == "length", out.error
        assert out.outputs[0].token_ids == expected
    for request_id in accepted:
        out = finals[request_id]
        if out.outputs[0].finish_reason == "error":
            assert isinstance(out.error, SamplingError), repr(out.error)
        else:
            assert out.error is None and out.outputs[0].finish_reason in ("stop", "length")
    assert llm.stats()["used_blocks"] == 0
