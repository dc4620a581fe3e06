"""Speculative decoding with n-gram drafts (`speculative_config={"method": "ngram", ...}`).

The proposer on hand-made sequences; the options checked at the door; greedy outputs identical token for
token with and without drafts (architectures, k = 1..5, chunked prefill, preemption, prefix caching, a
sliding window) while drafts really are accepted; seeded sampling identical too, and the verifier's
tokens distributed as the plain sampler's (synthetic logits, many draws); stops and max_tokens inside an
accepted run; abort, streaming, requests that never get drafts, the load threshold, the counters.

Two kinds of tiny model: the usual ones (initializer_range 0.2: chaotic output, most drafts rejected) and
"looping" ones (initializer_range 0.02: each token mostly decides the next, so the output soon cycles and
drafts are accepted in long runs).
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from gpu_support import gpu
from pagednb import LLM, RequestOutputKind, SamplingParams
from pagednb.engine.sampler import Sampler, SamplingMetadata
from pagednb.engine import output_processor
from pagednb.engine.cuda_graphs import DecodeGraphs
from pagednb.engine.spec_decode import drafter as drafter_module
from pagednb.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from pagednb.engine.spec_decode.config import SpeculativeConfig
from pagednb.engine.spec_decode.drafter import MAX_DRAFT_BATCH, Drafter
from pagednb.engine.spec_decode.ngram_proposer import NgramProposer
from pagednb.engine.spec_decode.verifier import DraftVerifier
from pagednb.metrics import Counter
from pagednb.request import Request
from tiny import hf_greedy

PROMPTS = ["Once upon a time there was a cat named Tom. " * 3, "The dog", "x",
           "The dog named Max ran to the park, found a red ball and brought it home. " * 2]


def ngram(k: int = 4, low: int = 1, high: int = 4) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": high, "prompt_lookup_min": low}


def run(path, spec: dict | None, prompts=PROMPTS, params=None, **options):
    """(each output, stats) of one engine on the CPU (path None: the embedded model)."""
    params = params or SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(path and str(path), device="cpu", speculative_config=spec, **options) as llm:  # None: embedded
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.check_integrity()
        assert llm.stats()["used_blocks"] == 0
        return outs, llm.stats()


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def looping(tiny_model_dir):
    return tiny_model_dir("llama", initializer_range=0.02)


# ---- the proposer -----------------------------------------------------------------------------------
def test_proposer_continues_the_longest_most_recent_match():
    p = NgramProposer(4, 1, 4)
    assert p.propose(np.array([1, 2, 3, 4, 5, 1, 2, 3])) == [4, 5, 1, 2]
    # "1 2" occurs twice before the end: the most recent occurrence is continued
    assert p.propose(np.array([1, 2, 9, 1, 2, 8, 5, 1, 2])) == [8, 5, 1, 2]
    # a longer match wins over a more recent shorter one: "3 1 2" (ends at index 2) beats "1 2"
    assert p.propose(np.array([3, 1, 2, 7, 1, 2, 6, 3, 1, 2])) == [7, 1, 2, 6]


def test_proposer_repeats_a_loop_shorter_than_k_and_respects_the_limits():
    assert NgramProposer(5, 1, 4).propose(np.array([4, 7, 7, 7])) == [7, 7, 7, 7, 7]
    assert NgramProposer(5, 1, 4).propose(np.array([9, 1, 2, 1, 2])) == [1, 2, 1, 2, 1]
    assert NgramProposer(5, 1, 4).propose(np.array([9, 1, 2, 1, 2]), max_drafts=2) == [1, 2]
    assert NgramProposer(5, 1, 4).propose(np.array([9, 1, 2, 1, 2]), max_drafts=0) == []
    assert NgramProposer(4, 1, 4).propose(np.array([1, 2, 3])) == []  # nothing repeats
    assert NgramProposer(4, 3, 4).propose(np.array([1, 2, 9, 1, 2])) == []  # "1 2" is shorter than 3
    assert NgramProposer(2, 3, 4).propose(np.array([1, 2, 3, 9, 1, 2, 3])) == [9, 1]
    assert NgramProposer(4, 1, 1).propose(np.array([5, 6, 5])) == [6, 5, 6, 5]


def test_a_request_whose_drafts_keep_failing_backs_off():
    """After m > 2 first drafts rejected in a row a request skips 2^(m - 2) - 1 chances to draft; a hit
    resets it. (A stub proposer always guesses 9.)"""
    class Guess9:
        def propose(self, tokens, max_drafts):
            return [9]

    drafter = Drafter(SpeculativeConfig("ngram", 2, 2, 1), max_model_len=1000)
    drafter.proposer = Guess9()
    req = Request("r", [1, 2, 1], SamplingParams(temperature=0), max_tokens=100)
    req.num_computed_tokens = 2
    drafted = []
    for token in [5] * 8 + [9] * 7:
        req.spec_token_ids = []
        drafter.propose([req])
        drafted.append(bool(req.spec_token_ids))
        req.all_token_ids.append(token)
        req.output_token_ids.append(token)
        req.num_computed_tokens += 1
    # misses at 0, 1, 2, 4 (then waits of 0, 0, 1, 3 chances); the 9 drafted at 8 is right: no more waiting
    assert [i for i, d in enumerate(drafted) if d] == [0, 1, 2, 4, 8, 9, 10, 11, 12, 13, 14]


# ---- options ----------------------------------------------------------------------------------------
def test_speculative_config_is_checked_naming_the_field():
    assert SpeculativeConfig.from_dict(ngram(3, 1, 4)) == SpeculativeConfig("ngram", 3, 4, 1)
    one_bound = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (one_bound.prompt_lookup_min, one_bound.prompt_lookup_max) == (3, 3)  # vLLM's rule
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['model'\].*accepted keys"):
        SpeculativeConfig.from_dict({**ngram(), "model": "x"})
    with pytest.raises(ValueError, match=r"speculative_config\['method'\] must be one of \('ngram',\), got 'eagle'"):
        SpeculativeConfig.from_dict({**ngram(), "method": "eagle"})
    with pytest.raises(ValueError, match=r"num_speculative_tokens'\] must be an int in \[1, 16\], got 0"):
        SpeculativeConfig.from_dict(ngram(k=0))
    with pytest.raises(ValueError, match=r"prompt_lookup_min'\] must be <= prompt_lookup_max \(2\), got 3"):
        SpeculativeConfig.from_dict(ngram(low=3, high=2))
    with pytest.raises(ValueError, match="needs 'num_speculative_tokens'"):
        SpeculativeConfig.from_dict({"method": "ngram"})
    with pytest.raises(TypeError, match="speculative_config must be None or a dict"):
        SpeculativeConfig.from_dict("ngram")


def test_llm_refuses_a_bad_speculative_config_before_loading(tiny_model_dir):
    with pytest.raises(ValueError, match=r"speculative_config\['method'\]"):
        LLM(str(tiny_model_dir("llama")), speculative_config={"method": "medusa", "num_speculative_tokens": 2})


# ---- greedy: identical with and without drafts --------------------------------------------------------
@pytest.mark.parametrize("arch, ks", [("llama", (1, 3, 5)), ("qwen3", (2, 4)), ("mistral", (5,))])
def test_greedy_outputs_are_identical_and_drafts_are_accepted(tiny_model_dir, arch, ks):
    """Looping models accept long runs (k = 1..5 over the architectures; mistral's sliding window turns
    prefix caching off and frees blocks behind the window); the chaotic one rejects most drafts. Both
    must give the plain engine's tokens, which equal HF's."""
    for overrides, expect_runs in (({"initializer_range": 0.02}, True), ({}, False)):
        path = tiny_model_dir(arch, **overrides)
        plain, _ = run(path, None, max_num_seqs=8)
        if arch == "llama":  # (test_engine_vs_hf checks every architecture's plain engine)
            assert token_ids(plain) == hf_greedy(path, PROMPTS, 48)
        for k in ks if expect_runs else (3,):
            spec, stats = run(path, ngram(k), max_num_seqs=8)
            assert token_ids(spec) == token_ids(plain), (arch, overrides, k)
            assert stats["spec_decode_num_draft_tokens"] > 0
            if expect_runs:  # drafts really passed verification, most of them
                assert stats["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_draft_tokens"] / 3
                assert stats["steps"] < 0.6 * 48 * len(PROMPTS) / 2


@pytest.mark.parametrize("k", [2, 4])
def test_chunked_prefill_preemption_and_prefix_caching_keep_outputs_identical(looping, k):
    """A budget of 12 tokens (chunks, drafts trimmed to the budget), a pool too small for all (preemption
    with recompute), prompts sharing a prefix (prefix hits), drafts accepted throughout."""
    prompts = PROMPTS + [PROMPTS[0] + "and a dog", PROMPTS[0] + "and a bird"]
    options = dict(max_num_seqs=6, max_num_batched_tokens=12, num_kv_blocks=24, block_size=8, max_model_len=128)
    plain, plain_stats = run(looping, None, prompts, **options)
    spec, stats = run(looping, ngram(k), prompts, **options)
    assert token_ids(spec) == token_ids(plain)
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_max_model_len_caps_the_drafts(looping):
    prompts = ["Once upon a time there was a cat named Tom. " * 2]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # up to max_model_len
    plain, _ = run(looping, None, prompts, params, max_model_len=64)
    spec, stats = run(looping, ngram(5), prompts, params, max_model_len=64)
    assert token_ids(spec) == token_ids(plain)
    assert spec[0].outputs[0].finish_reason == "length" and stats["spec_decode_num_accepted_tokens"] > 0
    assert len(spec[0].prompt_token_ids) + len(token_ids(spec)[0]) == 64


def test_decode_graph_steps_with_drafts_emulated_on_the_cpu(looping):
    """The CUDA-graph path (fixed inputs per bucket, padded rows, attention planned for max_model_len) with
    verify rows, each bucket's padded forward run eagerly in place of a replay: same tokens as plain."""
    class EagerGraphs(DecodeGraphs):
        def capture(self, padded_forward, device, progress=True):
            self._forwards = {size: padded_forward(size) for size in self.sizes}

        def replay(self, batch_size):
            self.num_replays += 1
            return self._forwards[batch_size]()

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain, _ = run(looping, None, PROMPTS, params, max_model_len=128)
    with LLM(str(looping), device="cpu", speculative_config=ngram(4), max_model_len=128, max_num_seqs=24) as llm:
        runner = llm.engine.runner
        runner.graphs = EagerGraphs(DecodeGraphs.bucket_sizes(24))
        runner.graphs.capture(runner._padded_decode_forward, runner.device)
        spec = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.stats()
        # every step but the prefill replayed, drafted ones included
        assert runner.graphs.num_replays == stats["steps"] - 1 and stats["spec_decode_num_accepted_tokens"] > 0
    assert token_ids(spec) == token_ids(plain)


# ---- sampling ----------------------------------------------------------------------------------------
def test_seeded_sampling_is_identical_with_and_without_drafts():
    """A seeded request draws one uniform per position whatever was drafted (the verifier winds its
    generator back past rejected rows), so its completion is the same token for token. The embedded
    model's stories repeat, so drafts are accepted."""
    prompts = ["Once upon a time", "Tell me a story about a dog named Max.", "Tell me a story about a cat named Tom."]
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=i, max_tokens=96, ignore_eos=True)
              for i, (t, p, k) in enumerate([(0.3, 1.0, -1), (0.4, 0.9, -1), (0.5, 0.95, 20)])]
    plain, _ = run(None, None, prompts, params)
    spec, stats = run(None, ngram(4), prompts, params)
    assert token_ids(spec) == token_ids(plain)
    # drafts accepted, and rejected too (their rows' uniforms drawn and given back)
    assert 5 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def _verify_many(logits: torch.Tensor, drafts: list[int], params: SamplingParams, n: int):
    """n requests, each verifying `drafts` against the same rows of logits ([1 + d, V]) in one sampler call:
    (each request's accepted count, its token after them)."""
    reqs = [Request(str(i), [0], params, 16) for i in range(n)]
    sched = SchedulerOutput(scheduled=[ScheduledRequest(r, 0, 1 + len(drafts), [], False, True, drafts) for r in reqs],
                            num_draft_tokens=n * len(drafts))
    rows = logits.repeat(n, 1)
    md = SamplingMetadata.build([params] * len(rows), [None] * len(rows), [[0]] * len(rows), [[]] * len(rows),
                                vocab_size=logits.shape[1], device=torch.device("cpu"),
                                generator=torch.Generator().manual_seed(1234))
    row_tokens = Sampler()(rows, md).token_ids.tolist()
    verifier = DraftVerifier()
    verifier.before_sampling(sched)
    last, accepted, _ = verifier.accept(sched, row_tokens, None)
    return np.array(accepted), np.array(last), verifier


def test_verified_tokens_follow_the_plain_samplers_distribution():
    """Rejection sampling of one-hot drafts: the first token is distributed as p_0 (temperature and top-k
    applied), the first draft accepted with probability p_0(d_1), and after an accepted draft the next token
    is distributed as p_1. Total-variation distances over 40,000 draws stay within sampling noise."""
    vocab, n, temperature, top_k = 6, 40_000, 0.7, 5
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0, -2.0], [0.1, 1.2, 0.3, -0.4, 0.5, 0.9], [0.0] * 6])
    drafts = [3, 1]
    params = SamplingParams(temperature=temperature, top_k=top_k)
    accepted, last, verifier = _verify_many(logits, drafts, params, n)
    scaled = logits / temperature
    scaled[scaled < scaled.topk(top_k, dim=1).values[:, -1:]] = float("-inf")
    p = scaled.softmax(-1).numpy()
    first = np.where(accepted >= 1, drafts[0], last)
    assert abs((accepted >= 1).mean() - p[0, drafts[0]]) < 4 * np.sqrt(p[0, 3] * (1 - p[0, 3]) / n)
    assert 0.5 * np.abs(np.bincount(first, minlength=vocab) / n - p[0]).sum() < 0.015
    second = np.where(accepted >= 2, drafts[1], last)[accepted >= 1]
    assert 0.5 * np.abs(np.bincount(second, minlength=vocab) / len(second) - p[1]).sum() < 0.025
    assert np.bincount(first, minlength=vocab)[5] == 0  # top-k removed it
    assert verifier.num_draft_tokens == 2 * n and verifier.num_accepted_tokens == int(accepted.sum())


def test_greedy_verification_accepts_while_the_draft_is_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    for drafts, accepted, last in (([1, 0, 2], 3, 0),  # all accepted, then the bonus token (argmax 0)
                                   ([1, 2, 2], 1, 0),  # the second draft fails: the argmax there, 0
                                   ([2, 0, 2], 0, 1)):
        got = _verify_many(logits, drafts, greedy, 1)
        assert (got[0].tolist(), got[1].tolist()) == ([accepted], [last])


# ---- stops, max_tokens, streaming, abort -----------------------------------------------------------------
def test_stops_and_max_tokens_inside_an_accepted_run_cut_there(monkeypatch):
    """The embedded model copies "named Max." from the prompt in accepted runs. Stop tokens and stop strings
    of the prompt's words end requests inside such runs (the hooks below count that it happened), and
    max_tokens caps runs. Every output (tokens, text, finish and stop reasons) is the plain engine's."""
    cut = {"token": 0, "string": 0}
    append = Scheduler._append_accepted_drafts
    until_stop = output_processor._update_until_stop

    def counting_append(self, req, drafts):
        status = append(self, req, drafts)
        cut["token"] += status is not None
        return status

    def counting_until_stop(req, detokenizer, new_tokens):
        num_tokens = req.num_output_tokens
        stop = until_stop(req, detokenizer, new_tokens)
        cut["string"] += req.num_output_tokens < num_tokens
        return stop

    monkeypatch.setattr(drafter_module, "MAX_BACKOFF_STEPS", 0)  # draft at every chance: runs where they can be
    monkeypatch.setattr(Scheduler, "_append_accepted_drafts", counting_append)
    monkeypatch.setattr(output_processor, "_update_until_stop", counting_until_stop)
    prompt = "Tell me a story about a dog named Max."
    with LLM(device="cpu") as llm:
        tokenizer = llm.get_tokenizer()
    words = tokenizer(prompt).input_ids[-3:-1]  # " named", " Max"
    cases = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop_token_ids=[t]) for t in words]
    cases += [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[tokenizer.decode([t])],
                             include_stop_str_in_output=include) for t in words for include in (False, True)]
    cases += [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (15, 18, 21)]
    plain, _ = run(None, None, [prompt] * len(cases), cases, max_num_seqs=32)
    assert cut == {"token": 0, "string": 0}
    spec, stats = run(None, ngram(4), [prompt] * len(cases), cases, max_num_seqs=32)
    for params, a, b in zip(cases, (o.outputs[0] for o in plain), (o.outputs[0] for o in spec)):
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason,
                                                                         a.stop_reason), params
    assert cut["token"] > 0 and cut["string"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0


def test_streamed_deltas_carry_accepted_runs_and_join_to_the_final_text(looping):
    with LLM(str(looping), device="cpu", speculative_config=ngram(4)) as llm:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        rid = engine.add_request(None, PROMPTS[0], params)
        texts, ids = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id == rid
                texts.append(out.outputs[0].text)
                ids.append(out.outputs[0].token_ids)
        final = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert "".join(texts) == final.text and sum(ids, []) == final.token_ids
    assert max(len(t) for t in ids) > 2  # an accepted run arrived as one delta


def test_async_stream_of_a_drafted_request(looping):
    async def collect(llm):
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        return [out.outputs[0].text async for out in llm.stream(PROMPTS[3], params)]

    with LLM(str(looping), device="cpu", speculative_config=ngram(3)) as llm:
        deltas = asyncio.run(collect(llm))
        final = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].text
    assert "".join(deltas) == final and llm.engine.closed


def test_abort_in_the_middle_of_drafted_decoding_frees_every_block(looping):
    with LLM(str(looping), device="cpu", speculative_config=ngram(4), num_kv_blocks=64) as llm:
        engine = llm.engine
        rids = [engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
                for p in PROMPTS]
        while llm.stats()["spec_decode_num_accepted_tokens"] < 8:
            engine.step()
        engine.abort_request(rids)
        finished = [o for o in engine.step() if o.finished]
        assert sorted(o.request_id for o in finished) == sorted(rids)
        assert all(o.outputs[0].finish_reason == "abort" for o in finished)
        assert not engine.has_unfinished_requests() and llm.stats()["used_blocks"] == 0
        engine.check_integrity()


# ---- requests without drafts, load, counters --------------------------------------------------------------
def test_requests_that_are_never_drafted_for_stay_exact_beside_drafted_ones(looping):
    """logprobs, a penalty and logit_bias in one batch with a plain greedy request that gets drafts, then
    n > 1: every output (logprobs included) is the plain engine's."""
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={300: 2.0})]
    plain, _ = run(looping, None, PROMPTS, params)
    spec, stats = run(looping, ngram(4), PROMPTS, params)
    assert token_ids(spec) == token_ids(plain) and stats["spec_decode_num_accepted_tokens"] > 0
    # the same positions, tokens and ranks; values as exact as a batch of another shape computes them
    got, want = spec[1].outputs[0].logprobs, plain[1].outputs[0].logprobs
    ranks = lambda logprobs: [{t: lp.rank for t, lp in pos.items()} for pos in logprobs]  # noqa: E731
    assert ranks(got) == ranks(want)
    assert np.allclose([lp.logprob for pos in got for lp in pos.values()],
                       [lp.logprob for pos in want for lp in pos.values()], atol=1e-5)
    n2 = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    both, _ = run(looping, ngram(4), [PROMPTS[0]], n2)
    assert [c.token_ids for c in both[0].outputs] == [token_ids(plain)[0]] * 2


def test_no_drafts_while_more_than_the_threshold_run(looping):
    n = MAX_DRAFT_BATCH + 4
    prompts = [f"{i} " + PROMPTS[1] for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(looping), device="cpu", speculative_config=ngram(4), max_num_seqs=64) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)  # all n run together from the first step
        assert llm.stats()["spec_decode_num_drafts"] == 0
        few = llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)
        assert llm.stats()["spec_decode_num_drafts"] > 0
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs) and len(few) == 4


def test_counters_in_stats_and_metrics(looping):
    with LLM(str(looping), device="cpu", speculative_config=ngram(4)) as llm:
        out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                           use_tqdm=False)[0]
        stats, metrics = llm.stats(), {m.name: m for m in llm.get_metrics()}
    drafts, accepted = stats["spec_decode_num_drafts"], stats["spec_decode_num_accepted_tokens"]
    assert 0 < accepted <= stats["spec_decode_num_draft_tokens"] <= 4 * drafts
    assert stats["spec_decode_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert stats["steps"] < len(out.outputs[0].token_ids)  # fewer steps than tokens: runs were accepted
    assert stats["generated_tokens"] == len(out.outputs[0].token_ids)
    assert isinstance(metrics["pagednb:spec_decode_num_accepted_tokens"], Counter)


def test_step_reports_show_a_drafted_row_as_a_decode_with_its_drafts(looping):
    with LLM(str(looping), device="cpu", speculative_config=ngram(3)) as llm:
        reports = []
        stop = llm.on_step(reports.append)
        llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
        stop()
    drafted = [(report, row) for report in reports for row in report.rows if row.num_draft_tokens]
    assert drafted and all(row.kind == "decode" and row.num_tokens == 1 + row.num_draft_tokens for _, row in drafted)
    assert f"({drafted[0][1].num_tokens}, {drafted[0][1].num_draft_tokens} drafts)" in str(drafted[0][0])


def test_asynchronous_scheduling_above_the_threshold_and_drafts_below_it(looping):
    """With asynchronous scheduling (the GPU default) a batch above MAX_DRAFT_BATCH overlaps its steps and
    drafts nothing; as requests finish it turns synchronous and drafted. Outputs stay the plain engine's."""
    n = MAX_DRAFT_BATCH + 8
    prompts = [f"{i} " + PROMPTS[i % 2] for i in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True) for i in range(n)]
    plain, _ = run(looping, None, prompts, params, max_num_seqs=64)
    with LLM(str(looping), device="cpu", async_scheduling=True, speculative_config=ngram(4), max_num_seqs=64) as llm:
        engine = llm.engine
        for prompt, p in zip(prompts, params):
            engine.add_request(None, prompt, p)
        overlapped = []
        outs = {}
        while engine.has_unfinished_requests():
            overlapped.append(not engine.needs_sync)
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0 and any(overlapped) and not all(overlapped)
        assert llm.stats()["used_blocks"] == 0
    spec = [outs[rid] for rid in sorted(outs, key=int)]
    assert token_ids(spec) == token_ids(plain)


# ---- GPU ---------------------------------------------------------------------------------------------
def _gpu_run(path, dtype, spec, prompts, params):
    # 32 sequences: graphs up to 32 rows, so every step's 4 x (1 + 4) rows replay one
    with LLM(str(path), dtype=dtype, num_kv_blocks=128, max_num_seqs=32, speculative_config=spec) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        replays = llm.engine.runner.graphs.num_replays
        return token_ids(outs), replays, llm.stats()


@gpu
def test_gpu_greedy_outputs_are_identical_with_and_without_drafts(tiny_model_dir):
    """float32: identical and equal to HF, verify steps replaying CUDA graphs; bf16: the first tokens agree
    (verify rows and plain decode rows run the same kernels, but a GEMM over more rows may round a near-tie
    the other way)."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for overrides in ({"initializer_range": 0.02}, {}):
        path = tiny_model_dir("llama", **overrides)
        plain, _, _ = _gpu_run(path, "float32", None, PROMPTS, params)
        spec, replays, stats = _gpu_run(path, "float32", ngram(4), PROMPTS, params)
        assert spec == plain == hf_greedy(path, PROMPTS, 48, device="cuda")
        assert replays > 5 and stats["spec_decode_num_draft_tokens"] > 0
    path = tiny_model_dir("llama", initializer_range=0.02, hidden_size=256)
    plain, _, _ = _gpu_run(path, "bfloat16", None, PROMPTS, params)
    spec, _, stats = _gpu_run(path, "bfloat16", ngram(4), PROMPTS, params)
    assert sum(a[:8] == b[:8] for a, b in zip(plain, spec)) >= len(PROMPTS) - 1, (plain, spec)
    assert stats["spec_decode_num_accepted_tokens"] > 0



@gpu
def test_gpu_seeded_sampling_is_identical_with_and_without_drafts():
    """The fused temperature kernel and the device generators: a seeded request's tokens do not depend on
    its drafts (float32, the embedded model, whose stories repeat)."""
    prompts = ["Once upon a time", "Tell me a story about a dog named Max."]
    params = [SamplingParams(temperature=0.6, seed=i, max_tokens=96, ignore_eos=True) for i in range(2)]
    runs = []
    for spec in (None, ngram(4)):
        with LLM(dtype="float32", num_kv_blocks=128, max_num_seqs=32, speculative_config=spec) as llm:
            runs.append(token_ids(llm.generate(prompts, params, use_tqdm=False)))
            stats = llm.stats()
    assert runs[0] == runs[1] and stats["spec_decode_num_accepted_tokens"] > 0
