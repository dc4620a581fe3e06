"""Logprobs and prompt logprobs as vLLM returns them ({token_id: Logprob(logprob, rank, decoded_token)}),
checked against HF transformers' log_softmax of the same sequence: raw logprobs (before temperature),
top-k ranks, the sampled token's own rank, the whole vocabulary with -1, and prompt logprobs that
survive chunked prefill, prefix-cache hits and preemption."""
import pytest
import torch
from gpu_support import gpu
from tiny import VOCAB_SIZE

from pagednb import LLM, Logprob, RequestOutputKind, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
TOL = 1e-4
K = 5
PROMPTS = [
    "Once upon a time there was a cat named Tom. Tom liked milk and long naps in the sun.",
    "The dog",
    "Unicode text: café, naïve, Grüße, 東京",
]


def cpu_llm(path, **engine_args) -> LLM:
    """The engine in float32 on the CPU, where the 1e-4 comparison with HF is meaningful on any machine."""
    return LLM(str(path), dtype="float32", device="cpu", **engine_args)


def hf_logprobs(path, sequences: list[list[int]], device: str = "cpu") -> list[torch.Tensor]:
    """HF transformers' float32 log_softmax at every position of each sequence: row p scores token p + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    with torch.no_grad():
        return [hf(torch.tensor([seq], device=device)).logits[0].float().log_softmax(-1).cpu() for seq in sequences]


def check_position(entry: dict, token: int, ref: torch.Tensor, k: int) -> None:
    """One position's {token_id: Logprob} against HF's log_softmax row `ref`: the chosen token with its
    logprob and rank, then exactly the top-k with ranks 1..k."""
    assert all(isinstance(v, Logprob) for v in entry.values())
    chosen = entry[token]
    assert abs(chosen.logprob - ref[token].item()) < TOL
    # rank = 1 + tokens more likely (ties counted as more likely); a tie within TOL may go either way
    above, at_least = (ref > ref[token] + TOL).sum().item(), (ref >= ref[token] - TOL).sum().item()
    assert above + 1 <= chosen.rank <= at_least
    top_k = sorted(((t, v) for t, v in entry.items() if v.rank <= k), key=lambda item: item[1].rank)
    assert [v.rank for _, v in top_k] == list(range(1, k + 1))
    assert set(entry) == {token} | {t for t, _ in top_k}  # nothing else
    ref_top = ref.topk(k)
    for (t, v), ref_value in zip(top_k, ref_top.values.tolist()):
        assert abs(v.logprob - ref_value) < TOL and abs(ref[t].item() - ref_value) < TOL


@pytest.fixture(scope="module", params=ARCHS)
def arch_path(request, tiny_model_dir):
    return tiny_model_dir(request.param)


def test_logprobs_and_prompt_logprobs_equal_hf(arch_path):
    """A hot seeded draw (so sampled tokens are often not the top one) with logprobs and prompt logprobs:
    every value, every top-k and every rank as HF's float32 log_softmax gives them (raw: temperature,
    top_p and the repetition penalty change what is drawn, not what is reported)."""
    params = SamplingParams(temperature=1.5, top_p=0.95, repetition_penalty=1.2, seed=7, max_tokens=12,
                            ignore_eos=True, logprobs=K, prompt_logprobs=K)
    with cpu_llm(arch_path) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    refs = hf_logprobs(arch_path, [o.prompt_token_ids + o.outputs[0].token_ids for o in outs])
    sampled_ranks = []
    for out, ref in zip(outs, refs):
        prompt, completion = out.prompt_token_ids, out.outputs[0]
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for p in range(1, len(prompt)):
            check_position(out.prompt_logprobs[p], prompt[p], ref[p - 1], K)
        assert len(completion.logprobs) == len(completion.token_ids) == 12
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            check_position(entry, token, ref[len(prompt) + i - 1], K)
            sampled_ranks.append(entry[token].rank)
        total = sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs))
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert max(sampled_ranks) > K  # sampled tokens outside the top-k were seen, with their own rank


def prompt_logprobs_of(llm, prompt, k=3):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    return out, [None if e is None else {t: (v.logprob, v.rank) for t, v in e.items()} for e in out.prompt_logprobs]


def close(a, b):
    """Two prompt_logprobs lists (as prompt_logprobs_of gives them) equal within TOL, same ids and ranks."""
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys()
        for t in x:
            assert abs(x[t][0] - y[t][0]) < TOL and x[t][1] == y[t][1]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_survive_chunked_prefill_and_prefix_hits(tiny_model_dir, async_scheduling):
    """The same prompt scored in one prefill, in chunks of 5 tokens, and again after it is cached: the
    same prompt logprobs each time. The prompt-logprob request takes no prefix hit (vLLM's rule), while
    the same prompt without them does, so the cache really held it. With asynchronous scheduling the
    chunks' steps overlap and still record in order."""
    path = tiny_model_dir("llama")
    prompt = PROMPTS[0] + " " + PROMPTS[0]  # several 16-token blocks
    with cpu_llm(path) as llm:
        whole_out, whole = prompt_logprobs_of(llm, prompt)
    ref = hf_logprobs(path, [whole_out.prompt_token_ids])[0]
    ids = whole_out.prompt_token_ids
    for p in range(1, len(ids)):
        assert abs(whole[p][ids[p]][0] - ref[p - 1, ids[p]].item()) < TOL
    with cpu_llm(path, max_num_batched_tokens=5, block_size=16, async_scheduling=async_scheduling) as llm:
        first_out, chunked = prompt_logprobs_of(llm, prompt)
        plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
        assert plain.num_cached_tokens >= 16  # a hit: the prompt's blocks were in the cache
        again_out, again = prompt_logprobs_of(llm, prompt)
        assert again_out.num_cached_tokens == 0  # recomputed, not read from the cache
        llm.engine.check_integrity()
    close(whole, chunked)
    close(whole, again)
    assert first_out.outputs[0].token_ids == again_out.outputs[0].token_ids == whole_out.outputs[0].token_ids


def test_prompt_logprobs_survive_preemption(tiny_model_dir):
    """A pool too small for all requests at once: preempted requests recompute their prompts, and each
    prompt position is still reported once, equal to HF."""
    path = tiny_model_dir("llama")
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0][::-1], PROMPTS[2] + PROMPTS[1]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    with cpu_llm(path, num_kv_blocks=9, block_size=16, max_model_len=128) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["preemptions"] > 0
    refs = hf_logprobs(path, [o.prompt_token_ids + o.outputs[0].token_ids for o in outs])
    for out, ref in zip(outs, refs):
        prompt = out.prompt_token_ids
        assert len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            check_position(out.prompt_logprobs[p], prompt[p], ref[p - 1], 2)
        for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            check_position(entry, token, ref[len(prompt) + i - 1], 1)


def test_minus_one_gives_the_whole_vocabulary(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=-1, prompt_logprobs=-1)
    with cpu_llm(path) as llm:
        out = llm.generate("The dog", params, use_tqdm=False)[0]
    ref = hf_logprobs(path, [out.prompt_token_ids + out.outputs[0].token_ids])[0]
    entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    assert len(entries) == len(out.prompt_token_ids) - 1 + 3
    for row, entry in zip(ref, entries):
        assert sorted(entry) == list(range(VOCAB_SIZE))
        assert sorted(v.rank for v in entry.values()) == list(range(1, VOCAB_SIZE + 1))
        values = torch.tensor([entry[t].logprob for t in range(VOCAB_SIZE)])
        assert torch.allclose(values, row, atol=TOL)


def test_decoded_token_is_the_tokens_own_text_and_none_without_detokenize(tiny_model_dir):
    path = tiny_model_dir("llama")
    with cpu_llm(path) as llm:
        out = llm.generate("Unicode text: café", SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                                prompt_logprobs=3), use_tqdm=False)[0]
        tok = llm.get_tokenizer()
        plain = llm.generate("Unicode text: café", SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                                  prompt_logprobs=3, detokenize=False),
                             use_tqdm=False)[0]
    pieces = 0
    for entry in out.prompt_logprobs[1:] + out.outputs[0].logprobs:
        for token_id, lp in entry.items():
            assert lp.decoded_token == tok.decode([token_id])
            pieces += bool(lp.decoded_token)
    assert pieces > 0
    # detokenize=False: the same numbers, no text
    for ours, theirs in zip(plain.prompt_logprobs[1:] + plain.outputs[0].logprobs,
                            out.prompt_logprobs[1:] + out.outputs[0].logprobs):
        assert {t: (v.logprob, v.rank) for t, v in ours.items()} == {t: (v.logprob, v.rank) for t, v in theirs.items()}
        assert all(v.decoded_token is None for v in ours.values())


def test_delta_outputs_carry_each_tokens_logprobs_once(tiny_model_dir):
    path = tiny_model_dir("llama")
    base = dict(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    with cpu_llm(path) as llm:
        final = llm.generate("The cat", SamplingParams(**base), use_tqdm=False)[0]
        rid = llm.engine.add_request(None, "The cat", SamplingParams(**base, output_kind=RequestOutputKind.DELTA))
        deltas = []
        while llm.engine.has_unfinished_requests():
            deltas += [o for o in llm.engine.step() if o.request_id == rid]
    assert [e for d in deltas for e in d.outputs[0].logprobs] == final.outputs[0].logprobs
    assert deltas[0].prompt_logprobs == final.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_counts_are_checked_at_the_door(tiny_model_dir, field):
    with pytest.raises(ValueError, match=f"{field}.*>= -1"):
        SamplingParams(**{field: -2})
    with pytest.raises(TypeError, match=field):
        SamplingParams(**{field: 2.5})
    with cpu_llm(tiny_model_dir("llama")) as llm:
        with pytest.raises(ValueError, match=f"{field}.*vocabulary size \\({VOCAB_SIZE}\\)"):
            llm.engine.add_request(None, "The cat", SamplingParams(**{field: VOCAB_SIZE + 1}))
        out = llm.generate("The cat", SamplingParams(temperature=0, max_tokens=2, **{field: VOCAB_SIZE}),
                           use_tqdm=False)[0]  # the whole vocabulary is allowed, and the engine still serves
    assert out.finished


@gpu
@pytest.mark.parametrize("budget", [None, 7], ids=["whole-prefill", "chunked"])
def test_gpu_bf16_logprobs_within_vllms_tolerance(tiny_model_dir, budget):
    """bf16 on the GPU (CUDA graphs, asynchronous scheduling) vs HF float32: at every position each side's
    top token is in the other's top-k (the tolerance vLLM's own logprob tests use)."""
    path = tiny_model_dir("qwen3")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    with LLM(str(path), dtype="bfloat16", max_num_batched_tokens=budget) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    refs = hf_logprobs(path, [o.prompt_token_ids + o.outputs[0].token_ids for o in outs], device="cuda")
    for out, ref in zip(outs, refs):
        entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
        assert len(entries) == len(ref) - 1
        for entry, row in zip(entries, ref):
            ours = {t for t, v in entry.items() if v.rank <= K}
            theirs = set(row.topk(K).indices.tolist())
            ours_top = min(entry.items(), key=lambda item: item[1].rank)[0]
            assert row.argmax().item() in ours and ours_top in theirs
