"""Structured output (xgrammar): every output of the embedded model follows its JSON schema, regex, choice
or grammar; bad specs are refused at add time; the bitmask masks exactly the tokens the grammar forbids."""
from __future__ import annotations

import json
import re
import string
import sys

import pytest
import torch

xgr = pytest.importorskip("xgrammar", reason='structured output needs the extra: pip install "pagednb[structured]"')
jsonschema = pytest.importorskip("jsonschema")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpu_support import CUDA, GPU_REASON  # noqa: E402
from pagednb import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagednb.request import RequestStatus  # noqa: E402
from pagednb.engine.structured_output import (  # noqa: E402
    GrammarCache, choice_grammar, import_xgrammar, mask_disallowed)

PROMPTS = ["Once upon a time", "The cat", "Write JSON:", "A story about a frog", "Hello"]


@pytest.fixture(scope="module")
def llm():
    engine = LLM()
    yield engine
    engine.llm_engine.close()


# ---- random JSON schemas --------------------------------------------------------------------------------
NAMES = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=8)


def _string_schema():
    return st.tuples(st.integers(0, 3), st.integers(0, 8)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]})


def _integer_schema():
    bounded = st.tuples(st.integers(-1000, 1000), st.integers(0, 5000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    return st.one_of(st.just({"type": "integer"}), bounded)


def _leaf_schema():
    return st.one_of(
        _string_schema(), _integer_schema(), st.just({"type": "number"}), st.just({"type": "boolean"}),
        st.lists(st.one_of(st.text(alphabet=string.ascii_letters + " ", max_size=6), st.integers(-50, 50)),
                 min_size=1, max_size=4, unique=True).map(lambda values: {"enum": values}))


def _array_schema(items):
    return st.tuples(items, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})


def _object_schema(values):
    def build(props_and_required):
        props, required = props_and_required
        return {"type": "object", "properties": props, "required": [k for k in props if k in required],
                "additionalProperties": False}
    props = st.dictionaries(NAMES, values, min_size=1, max_size=4)
    return props.flatmap(lambda p: st.tuples(st.just(p), st.sets(st.sampled_from(sorted(p))))).map(build)


def schemas():
    """Objects whose properties are strings, integers, numbers, booleans, enums, arrays or (nested) objects."""
    level1 = st.one_of(_leaf_schema(), _array_schema(_leaf_schema()))
    nested = _object_schema(level1)
    return _object_schema(st.one_of(level1, nested, _array_schema(nested)))


@settings(max_examples=1, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(st.lists(schemas(), min_size=200, max_size=200))
def test_200_random_schemas_every_output_validates(llm, drawn):
    """One batched generate of 200 requests, each with its own schema (greedy and seeded random rows)."""
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=400,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for i, schema in enumerate(drawn)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(drawn))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for schema, out in zip(drawn, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_true_and_json_object_start_an_object(llm):
    """Any JSON object: this story model fills its free-form strings until max_tokens, so the check is that
    the text is an object's start (and parses where it ended)."""
    for spec in (StructuredOutputsParams(json=True), StructuredOutputsParams(json_object=True)):
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=3, max_tokens=60, structured_outputs=spec),
                            use_tqdm=False)
        for out in outs:
            completion = out.outputs[0]
            assert completion.finish_reason in ("stop", "length") and completion.text.startswith("{")
            if completion.finish_reason == "stop":
                assert isinstance(json.loads(completion.text), dict)


@pytest.mark.parametrize("pattern", [r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
                                     r"[a-z]{1,8}(\.[a-z]{1,5})?@[a-z]{2,8}\.(com|org|net)",
                                     r"(yes|no), because [a-z ]{3,20}\."])
def test_regex_outputs_match(llm, pattern):
    params = [SamplingParams(temperature=t, seed=i, max_tokens=100,
                             structured_outputs=StructuredOutputsParams(regex=pattern))
              for i, t in enumerate([0.0, 0.7, 1.0, 1.5] * 5)]
    outs = llm.generate([PROMPTS[i % 5] for i in range(len(params))], params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text


def test_choice_outputs_are_choices(llm):
    choices = ["positive", "negative", "neutral ", 'say "hi"\\']
    params = [SamplingParams(temperature=t, seed=i, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(choice=choices))
              for i, t in enumerate([0.0, 1.0, 2.0] * 10)]
    outs = llm.generate([PROMPTS[i % 5] for i in range(len(params))], params, use_tqdm=False)
    texts = {o.outputs[0].text for o in outs}
    assert texts <= set(choices) and all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert len(texts) > 1  # random rows do reach different choices: the mask is per row


def test_structured_and_plain_rows_in_one_batch(llm):
    """Grammar rows are masked, the plain rows beside them sample exactly as they would alone."""
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)]
    digits = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}"))
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 5 + [digits] * 5, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:5]] == alone
    assert all(re.fullmatch("[0-9]{3}", o.outputs[0].text) for o in mixed[5:])


def test_ebnf_grammar(llm):
    grammar = 'root ::= "(" expr ")"\nexpr ::= num | num [+*] num\nnum ::= [1-9] [0-9]?'
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=5, max_tokens=30,
                                                structured_outputs=StructuredOutputsParams(grammar=grammar)),
                        use_tqdm=False)
    for out in outs:
        assert re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?)?\)", out.outputs[0].text), out.outputs[0].text


def test_ignore_eos_still_stops_when_the_grammar_ends(llm):
    out = llm.generate(["Hello"], SamplingParams(temperature=0, ignore_eos=True, max_tokens=50,
                                                 structured_outputs=StructuredOutputsParams(choice=["abc", "xyz"])),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("abc", "xyz")


@pytest.mark.parametrize("spec, field", [
    (dict(json={"type": "no-such-type"}), "json"),
    (dict(json="{not json"), "json"),
    (dict(regex="([a-z]"), "regex"),
    (dict(grammar="root ::= ("), "grammar"),
])
def test_uncompilable_spec_refused_at_add_time(llm, spec, field):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=rf"structured_outputs\.{field}"):
        engine.add_request("bad", "Hello", SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert "bad" not in engine.scheduler.requests and engine.stats()["waiting"] == 0  # nothing was queued
    ok = llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert ok.outputs[0].finish_reason in ("length", "stop")  # the engine serves on


@pytest.mark.parametrize("kwargs, error", [
    (dict(), ValueError), (dict(json={}, regex="a"), ValueError), (dict(choice=[]), ValueError),
    (dict(choice=["a", 3]), ValueError), (dict(regex=3), TypeError), (dict(json=3.5), TypeError),
    (dict(json_object="yes"), TypeError),
])
def test_params_need_exactly_one_valid_field(kwargs, error):
    with pytest.raises(error, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)


def test_structured_requests_keep_asynchronous_scheduling(llm):
    """Unlike penalties, a grammar does not need its request's output on the host before the next step is
    built: the step launches its forward and its sampling waits for the matcher (engine/structured_output.py)."""
    req = llm.llm_engine.make_request(None, "Hi", SamplingParams(
        structured_outputs=StructuredOutputsParams(regex="a+")))
    assert not req.needs_output_history


def test_compiled_grammars_are_cached(llm):
    llm.generate(["x"], SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="q[0-9]+")),
                 use_tqdm=False)
    cache = llm.llm_engine.logits_processors.grammars
    before = cache.num_compiled
    params = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="q[0-9]+"))
    llm.generate(PROMPTS, params, use_tqdm=False)
    assert cache.num_compiled == before
    llm.generate(["x"], SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="r[0-9]+")),
                 use_tqdm=False)
    assert cache.num_compiled == before + 1


def test_a_rejected_token_ends_that_request_alone_with_error(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{5,10}"))
    bad = engine.make_request("rejected", "Hello", params)
    good = engine.make_request("accepted", "Hello", params.clone())
    bad.logits_state.structured.accept = lambda token: False  # as if the sampler let a forbidden token through
    engine.enqueue(bad)
    engine.enqueue(good)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert finals["rejected"].finish_reason == "error"
    assert finals["accepted"].finish_reason == "stop" and re.fullmatch("[a-z]{5,10}", finals["accepted"].text)
    assert not engine.logits_processors.has_grammars  # finished requests are forgotten: plain steps again


def test_bitmask_on_cpu_masks_exactly_what_the_grammar_forbids(llm):
    engine = llm.llm_engine
    cache = GrammarCache(engine.tokenizer, engine.spec.vocab_size, sorted(engine.eos_token_ids))
    state = cache.new_state(StructuredOutputsParams(regex="ab+"))
    vocab = engine.spec.vocab_size
    bitmask = cache.allocate_bitmask(3)  # every token allowed; fill_bitmask leaves rows 0 and 2 so
    cache.fill_bitmask(bitmask, [state.matcher], [1])
    logits = torch.randn(3, vocab)
    masked = mask_disallowed(logits, bitmask)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])  # other rows untouched
    allowed = torch.isfinite(masked[1])
    vocab_text = [engine.tokenizer.decode([t]) for t in range(vocab)]
    for t in range(vocab):
        could_start = bool(vocab_text[t]) and re.fullmatch("ab*", vocab_text[t]) is not None
        assert bool(allowed[t]) == could_start, (t, vocab_text[t])
    assert torch.equal(masked[1][allowed], logits[1][allowed])


def test_choice_grammar_escapes_quotes_and_backslashes():
    assert choice_grammar(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


def test_missing_xgrammar_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ImportError, match=r'pip install "pagednb\[structured\]"'):
        import_xgrammar()


@pytest.mark.skipif(not CUDA, reason=GPU_REASON)
def test_reused_pinned_bitmask_allows_everything_in_rows_without_a_live_grammar(llm):
    """On a GPU the host bitmask is one pinned buffer reused step after step: a row whose request has no grammar,
    or finished since its step was launched, must allow every token whatever an earlier step left there."""
    engine = llm.llm_engine
    processors, device = engine.logits_processors, torch.device("cuda")
    reqs = [engine.make_request(None, PROMPTS[i], SamplingParams(
        structured_outputs=StructuredOutputsParams(regex="[0-9]+"))) for i in range(3)]
    plain = engine.make_request(None, PROMPTS[0], SamplingParams())
    for req in reqs:
        processors.register(req)
    first = processors.start_grammar_bitmask(reqs, [0, 1, 2], device, background=True)
    assert (processors.finish_grammar_bitmask(first, device).cpu() != -1).any(dim=1).all()  # digits only
    reqs[1].status = RequestStatus.FINISHED_ABORTED
    second = processors.start_grammar_bitmask([reqs[0], reqs[1], plain, reqs[2]], [0, 1, 3], device, background=True)
    rows = processors.finish_grammar_bitmask(second, device).cpu()
    assert (rows[1] == -1).all() and (rows[2] == -1).all()
    assert torch.equal(rows[0], rows[3]) and (rows[0] != -1).any()
    for req in reqs:  # leave the shared engine as it was: finished requests are forgotten at the next advance
        req.status = RequestStatus.FINISHED_ABORTED
    processors.advance([])
    assert not processors.has_grammars


@pytest.mark.skipif(not CUDA, reason=GPU_REASON)
def test_bitmask_on_cuda_matches_cpu_for_a_greedy_batch(llm):
    """The sampler's bitmask path on the GPU picks the same greedy tokens as on the CPU."""
    from pagednb.engine.sampler import Sampler, SamplingMetadata
    engine = llm.llm_engine
    vocab = engine.spec.vocab_size
    cache = GrammarCache(engine.tokenizer, vocab, sorted(engine.eos_token_ids))
    specs = [StructuredOutputsParams(regex=r"\d+"), StructuredOutputsParams(json={"type": "object"}),
             StructuredOutputsParams(choice=["yes", "no"])]
    rows = list(range(0, 64, 2))
    bitmask = cache.allocate_bitmask(64)
    cache.fill_bitmask(bitmask, [cache.new_state(specs[j % 3]).matcher for j in range(len(rows))], rows)
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(0))
    tokens = {}
    for device in ("cpu", "cuda"):
        md = SamplingMetadata.build([SamplingParams(temperature=0)] * 64, [None] * 64, [[1]] * 64, [[]] * 64,
                                    vocab, torch.device(device))
        md.grammar_bitmask = bitmask.to(device)
        tokens[device] = Sampler()(logits.to(device), md).token_ids.cpu()
    assert torch.equal(tokens["cpu"], tokens["cuda"])
    for row in rows:
        bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        assert bits.flatten()[tokens["cpu"][row]] == 1  # the chosen token is allowed by its grammar


def test_async_scheduling_engine_keeps_grammars_in_step():
    """With asynchronous scheduling (the GPU default) a structured request still sees every token before
    its next bitmask: requests joining mid-run, beside plain ones, all follow their grammars."""
    llm = LLM(async_scheduling=True)  # kept: dropping the LLM closes its engine
    engine = llm.llm_engine
    try:
        pattern = r"[a-z]{2,6}-[0-9]{2,4}"
        plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        engine.add_request("plain-0", PROMPTS[0], plain)
        engine.step()
        engine.step()  # the plain request is decoding with a step in flight when the others join
        for i in range(4):
            engine.add_request(f"regex-{i}", PROMPTS[i], SamplingParams(
                temperature=1.0, seed=i, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=pattern)))
        engine.add_request("plain-1", PROMPTS[1], plain)
        finals = {}
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
        for i in range(4):
            assert finals[f"regex-{i}"].finish_reason == "stop"
            assert re.fullmatch(pattern, finals[f"regex-{i}"].text), finals[f"regex-{i}"].text
        assert len(finals["plain-0"].token_ids) == len(finals["plain-1"].token_ids) == 8
    finally:
        llm.close()


# ---- structured output on an asynchronous engine ------------------------------------------------------------
OBJECT_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "required": ["name", "age"], "additionalProperties": False}


def _mixed_batch():
    """Plain rows (greedy, seeded random, logprobs) beside JSON-schema and regex rows of one batch."""
    json_params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json=OBJECT_SCHEMA))
    regex_params = SamplingParams(temperature=0.9, seed=11, max_tokens=30,
                                  structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,6}-[0-9]{2,4}"))
    plain = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=4, max_tokens=25, logprobs=2)]
    params = [json_params, plain[0], regex_params, json_params, plain[1], json_params, regex_params, plain[0]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    return prompts, params


def _run_stepwise(llm, prompts, params):
    """Adds the requests one step apart (joining while others decode, a step in flight) and steps to the
    end; returns {request id: final CompletionOutput}, how many steps with a grammar row were launched while
    an older step was still in flight (overlapped), and how many bitmasks were filled on the grammar thread."""
    engine, overlapped = llm.llm_engine, []
    launch = engine.runner.launch
    background = []

    def counting_launch(sched):
        grammar = any(s.request.sampling_params.structured_outputs is not None for s in sched.scheduled)
        overlapped.append(grammar and bool(engine._in_flight))
        return launch(sched)
    engine.runner.launch = counting_launch
    finals = {}
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", prompt, p)
            if i == 0:  # the grammar cache exists once a structured request was prepared
                cache = engine.logits_processors.grammars
                fill_in_background = cache.fill_in_background
                cache.fill_in_background = lambda *args: background.append(1) or fill_in_background(*args)
            finals.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    finally:
        engine.runner.launch = launch
    engine.check_integrity()
    return finals, sum(overlapped), len(background)


def _completion(c):
    return c.token_ids, c.text, c.finish_reason, [lp and sorted(lp.items()) for lp in c.logprobs or []]


def test_an_asynchronous_engine_overlaps_grammar_steps_with_the_same_tokens():
    """On an asynchronous engine a step with grammar rows is launched while the previous step is in flight;
    its sampling waits until the matchers took that step's tokens, its bitmask filled on the grammar thread:
    outputs identical to the synchronous engine's (greedy, seeded and logprob rows beside), every JSON output
    valid, nothing left behind."""
    prompts, params = _mixed_batch()
    runs = {}
    for async_scheduling in (False, True):
        with LLM(async_scheduling=async_scheduling) as llm:
            runs[async_scheduling] = _run_stepwise(llm, prompts, params)
            assert not llm.llm_engine.logits_processors.has_grammars  # finished requests forgotten
            assert llm.stats()["used_blocks"] == 0
    (sync, sync_overlapped, sync_background), (overlapped, async_overlapped, async_background) = runs[False], runs[True]
    assert sync_overlapped == sync_background == 0
    assert async_overlapped > 10 and async_background > 10
    assert {k: _completion(c) for k, c in overlapped.items()} == {k: _completion(c) for k, c in sync.items()}
    for i, p in enumerate(params):
        spec = p.structured_outputs
        if spec is not None and spec.json is not None:
            assert overlapped[f"r{i}"].finish_reason == "stop", overlapped[f"r{i}"].text
            jsonschema.validate(json.loads(overlapped[f"r{i}"].text), OBJECT_SCHEMA)


def test_invalid_grammar_refused_at_add_time_while_others_keep_running():
    """A spec that does not compile raises ValueError naming its field as it is added, with grammar and
    plain requests running on an asynchronous engine; they finish exactly as without it."""
    prompts, params = _mixed_batch()
    runs = []
    for add_bad in (False, True):
        with LLM(async_scheduling=True) as llm:
            engine = llm.llm_engine
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                engine.add_request(f"r{i}", prompt, p)
            finals = {}
            for _ in range(2):
                finals.update((o.request_id, _completion(o.outputs[0])) for o in engine.step() if o.finished)
            if add_bad:
                with pytest.raises(ValueError, match=r"structured_outputs\.regex could not be compiled"):
                    engine.add_request("bad", "Hello", SamplingParams(structured_outputs=StructuredOutputsParams(
                        regex="([a-z")))
                assert "bad" not in engine.scheduler.requests
            while engine.has_unfinished_requests():
                finals.update((o.request_id, _completion(o.outputs[0])) for o in engine.step() if o.finished)
            runs.append(finals)
    assert len(runs[1]) == len(params) and runs[1] == runs[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mask_disallowed_matches_xgrammars_kernel(dtype):
    """The sampler's bit unpacking (any dtype, a copy) masks exactly what xgrammar's CPU kernel masks in place,
    including a vocabulary that is not a multiple of 32."""
    vocab = 1000
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, -(-vocab // 32)), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab)
    masked = mask_disallowed(logits, bitmask)
    assert masked.dtype == dtype and torch.equal(masked, expected)
    assert torch.isinf(masked).sum() > 1000 and torch.isfinite(logits).all()  # masked a lot; input untouched


def test_greedy_grammar_rows_sample_from_model_dtype_logits_like_float32():
    """A greedy batch with a bitmask argmaxes the masked bf16 logits (no float32 copy); the tokens are those
    of the masked float32 copy."""
    from pagednb.engine.sampler import Sampler, SamplingMetadata
    vocab, n = 3000, 16
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(n, vocab, generator=gen).to(torch.bfloat16)
    bitmask = torch.randint(-2**31, 2**31 - 1, (n, -(-vocab // 32)), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[3] = -1  # a row without a grammar
    md = SamplingMetadata.build([SamplingParams(temperature=0)] * n, [None] * n, [[1]] * n, [[]] * n, vocab,
                                torch.device("cpu"))
    md.grammar_bitmask = bitmask
    tokens = Sampler()(logits, md).token_ids
    expected = mask_disallowed(logits.float(), bitmask).argmax(-1)
    assert torch.equal(tokens, expected)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    assert all(bits[i].flatten()[tokens[i]] == 1 for i in range(n))


@pytest.mark.skipif(not CUDA, reason=GPU_REASON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_mask_kernel_masks_in_place_exactly_what_torch_masks(dtype):
    """The CUDA bitmask kernel (in place) equals the torch unpacking on strided rows of a vocabulary that is
    not a multiple of 32, and a copy leaves its input untouched."""
    from pagednb.engine.sampling_kernel import mask_logits_
    vocab, n = 151_937, 37
    gen = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-2**31, 2**31 - 1, (n, -(-vocab // 32)), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[5] = -1
    bitmask[6] = 0
    wide = torch.randn(n, vocab + 7, generator=gen).to(dtype)
    expected = wide[:, :vocab].clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab)
    logits = wide.cuda()[:, :vocab]
    copy = mask_disallowed(logits, bitmask.cuda())
    assert torch.equal(copy.cpu(), expected) and torch.equal(logits.cpu(), wide[:, :vocab])
    assert mask_logits_(logits, bitmask.cuda())
    assert torch.equal(logits.cpu(), expected) and torch.isinf(expected[6]).all() and torch.equal(expected[5], wide[5, :vocab])


def test_a_grammar_fill_that_fails_ends_its_step_alone_and_the_engine_keeps_serving(monkeypatch):
    """If filling a step's bitmask raises, the requests of that step end with "error" (nothing escapes the
    engine's step), no block leaks, and later requests run."""
    json_params = SamplingParams(temperature=0, max_tokens=30,
                                 structured_outputs=StructuredOutputsParams(json=OBJECT_SCHEMA))
    fill, calls = GrammarCache.fill_bitmask, []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("fill broke")
        return fill(self, *args)
    monkeypatch.setattr(GrammarCache, "fill_bitmask", failing)
    with LLM(async_scheduling=True) as llm:
        engine = llm.llm_engine
        for i in range(3):
            engine.add_request(f"r{i}", PROMPTS[i], json_params)
        finals = {}
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
        assert len(calls) == 3
        assert {r: o.outputs[0].finish_reason for r, o in finals.items()} == {f"r{i}": "error" for i in range(3)}
        assert all(len(o.outputs[0].token_ids) == 2 for o in finals.values())  # the two steps before
        engine.check_integrity()
        assert llm.stats()["used_blocks"] == 0
        out = llm.generate([PROMPTS[0]], _mixed_batch()[1][0], use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), OBJECT_SCHEMA)
