"""Fault injection on the embedded model, as vLLM tests it: NaN (or +inf, or all -inf) logits injected
into one request's row end that request alone with finish_reason "error" and a SamplingError naming
the cause, while every other request of the same steps equals its solo greedy run; the blocks the
failed request computed leave the prefix cache, those it got from a prefix hit stay; a model forward
that raises after N steps ends that step's requests and the engine goes on serving. Synchronous and
asynchronous scheduling alike (the latter reads the flag one step late, with the next step in flight)."""
from __future__ import annotations

import random

import pytest

from pagednb import LLM, SamplingParams
from pagednb.request import SamplingError

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
BLOCK = 16  # the embedded model's default block size


pytestmark = pytest.mark.usefixtures("pool_checked_after_each_test")


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request):
    # eager: the injection wraps the model's compute_logits in Python, which a captured CUDA graph would
    # replay around (on the GPU the sampling kernel then meets the poisoned row, as on the CPU the sampler)
    engine = LLM(async_scheduling=request.param, enforce_eager=True)
    yield engine
    engine.close()


def random_prompts(llm, seed: int, lengths: list[int]) -> list[list[int]]:
    """Token-id prompts no other test uses (so nothing of theirs is in the prefix cache yet)."""
    rng = random.Random(seed)
    vocab = llm.engine.spec.vocab_size
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def poison_logits(llm, request_id: str, output_token: int, value: float):
    """Sets request_id's row of the logits to `value` in the step that samples its output_token-th token
    (1-based), by wrapping the model's compute_logits; returns the undo function."""
    runner = llm.engine.runner
    real_launch, real_logits = runner.launch, runner.model.compute_logits
    target: dict = {"row": None}

    def launch(sched, *args):
        rows = [s.request for s in sched.scheduled if s.samples]
        # the token this step samples is output number len(output) + pending (pending counts it already)
        target["row"] = next((i for i, r in enumerate(rows) if r.request_id == request_id
                              and r.num_output_tokens + r.num_pending_tokens == output_token), None)
        return real_launch(sched, *args)

    def compute_logits(hidden):
        logits = real_logits(hidden)
        if target["row"] is not None:
            logits = logits.clone()
            logits[target["row"]] = value
        return logits
    runner.launch, runner.model.compute_logits = launch, compute_logits

    def undo():
        runner.launch, runner.model.compute_logits = real_launch, real_logits
    return undo


def run_batch(llm, prompts: dict[str, list[int]], params=GREEDY) -> dict:
    """Adds every prompt through the step API and steps until all end; the final output of each."""
    engine, finals = llm.engine, {}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()
    return finals


def solo(llm, prompt: list[int], params=GREEDY) -> list[int]:
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_bad_logits_in_one_row_end_only_that_request(llm, value):
    prompts = random_prompts(llm, seed={"nan": 1, "inf": 2, "-inf": 3}[str(value)], lengths=[5, 23, 40, 9])
    expected = {f"ok{i}": solo(llm, p) for i, p in enumerate(prompts[1:])}
    batch = {"bad": prompts[0], **{f"ok{i}": p for i, p in enumerate(prompts[1:])}}
    undo = poison_logits(llm, "bad", output_token=5, value=value)
    try:
        finals = run_batch(llm, batch)
    finally:
        undo()
    bad = finals.pop("bad")
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert isinstance(bad.error, SamplingError)
    assert "output token 5" in str(bad.error) and "NaN" in str(bad.error)
    assert len(bad.outputs[0].token_ids) == 4  # the tokens before the bad row are kept
    assert {r: (o.outputs[0].finish_reason, o.outputs[0].token_ids) for r, o in finals.items()} == \
        {r: ("length", ids) for r, ids in expected.items()}
    assert llm.stats()["used_blocks"] == 0
    # the engine goes on: the failed prompt again, unpoisoned, runs to its length
    assert len(solo(llm, prompts[0])) == GREEDY.max_tokens


def test_a_failed_requests_own_blocks_leave_the_prefix_cache(llm):
    own, control = random_prompts(llm, seed=11, lengths=[70, 70])
    assert not llm.generate({"prompt_token_ids": control}, GREEDY, use_tqdm=False)[0].num_cached_tokens
    # control: a finished request's full blocks serve the next request with its prompt
    again = llm.generate({"prompt_token_ids": control}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == (70 - 1) // BLOCK * BLOCK
    undo = poison_logits(llm, "bad", output_token=3, value=float("nan"))
    try:
        finals = run_batch(llm, {"bad": own})
    finally:
        undo()
    assert finals["bad"].outputs[0].finish_reason == "error"
    # its prompt blocks were cached while it ran (committed after each step); now they are gone
    assert llm.generate({"prompt_token_ids": own}, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_blocks_it_got_from_a_prefix_hit_stay_cached(llm):
    shared, suffix = random_prompts(llm, seed=12, lengths=[40, 30])
    llm.generate({"prompt_token_ids": shared}, GREEDY, use_tqdm=False)  # computes 2 full blocks of `shared`
    undo = poison_logits(llm, "bad", output_token=2, value=float("nan"))
    try:
        finals = run_batch(llm, {"bad": shared + suffix})
    finally:
        undo()
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert finals["bad"].num_cached_tokens == 32  # it started from those two blocks
    # a later request with the same prompt: a hit on what the other request computed, nothing beyond
    assert llm.generate({"prompt_token_ids": shared + suffix}, GREEDY, use_tqdm=False)[0].num_cached_tokens == 32


def test_a_forward_that_raises_after_n_steps_ends_that_steps_requests_and_the_engine_goes_on(llm):
    prompts = random_prompts(llm, seed=13, lengths=[7, 19])
    expected = [solo(llm, p) for p in prompts]
    model = llm.engine.runner.model
    real_forward, calls = model.forward, {"n": 0}

    def forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected forward failure")
        return real_forward(*args, **kwargs)
    model.forward = forward
    try:
        finals = run_batch(llm, {"a": prompts[0], "b": prompts[1]})
    finally:
        del model.forward
    assert {r: o.outputs[0].finish_reason for r, o in finals.items()} == {"a": "error", "b": "error"}
    assert all("injected forward failure" in str(o.error) for o in finals.values())
    assert llm.stats()["used_blocks"] == 0
    assert [solo(llm, p) for p in prompts] == expected  # served as before, from a consistent cache
