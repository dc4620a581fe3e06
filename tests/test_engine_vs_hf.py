"""Greedy outputs equal HF transformers' `generate` token for token, for each supported architecture,
however the engine batches the work: mixed prompt lengths in one batch, a tiny token budget (chunked
prefill), shared prefixes (prefix-cache hits), a pool so small it must preempt, prompts longer than
Mistral's sliding window."""
import pytest
from tiny import EQUIVALENCE_PROMPTS as PROMPTS, SHARED_PREFIX as SHARED, hf_greedy

from pagednb import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
ORACLE_DTYPE = "float32"  # the oracle's (tiny.hf_greedy); "auto" would be bf16 on a GPU


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tiny_model_dir):
    """(model dir, the HF reference continuation of every prompt)."""
    path = tiny_model_dir(request.param)
    return request.param, path, hf_greedy(path, PROMPTS, MAX_NEW)


def generate_all(path, **engine_args):
    with LLM(str(path), dtype=ORACLE_DTYPE, **engine_args) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.stats()
        llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs], stats


def test_batch_of_mixed_lengths_matches_hf(arch_case):
    _, path, refs = arch_case
    got, stats = generate_all(path, num_kv_blocks=64)
    assert got == refs
    assert stats["used_blocks"] == 0


def test_tiny_token_budget_forces_chunked_prefill_and_still_matches(arch_case):
    _, path, refs = arch_case
    got, _ = generate_all(path, num_kv_blocks=64, max_num_batched_tokens=7)
    assert got == refs


def test_prefix_cache_hits_do_not_change_outputs(arch_case):
    arch, path, refs = arch_case
    with LLM(str(path), dtype=ORACLE_DTYPE, num_kv_blocks=64) as llm:
        first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # served from cached blocks
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in first] == refs
    assert [o.outputs[0].token_ids for o in second] == refs
    if arch == "mistral":
        assert stats["prefix_cache_hit_tokens"] == 0  # prefix caching is off with a sliding window
    else:
        assert stats["prefix_cache_hit_tokens"] > 0
        assert sum(o.num_cached_tokens for o in second) > 0


def test_a_pool_too_small_for_everyone_preempts_and_still_matches(arch_case):
    _, path, refs = arch_case
    got, stats = generate_all(path, num_kv_blocks=8, max_model_len=112)
    assert got == refs
    assert stats["preemptions"] > 0


def test_mistral_prompts_longer_than_the_window_match_hf(tiny_model_dir):
    path = tiny_model_dir("mistral", sliding_window=8)
    prompt = SHARED * 2
    (ref,) = hf_greedy(path, [prompt], MAX_NEW)
    with LLM(str(path), dtype=ORACLE_DTYPE, num_kv_blocks=64, max_num_batched_tokens=5) as llm:
        assert llm.engine.spec.sliding_window == 8
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 8 * 3
    assert out.outputs[0].token_ids == ref


def test_asynchronous_scheduling_matches_hf_with_chunks_and_preemption(arch_case):
    """The next step scheduled before this one's tokens are known (the GPU default), under a tiny
    budget and a pool that forces preemption."""
    _, path, refs = arch_case
    got, stats = generate_all(path, num_kv_blocks=8, max_model_len=112, max_num_batched_tokens=7,
                              async_scheduling=True)
    assert got == refs
    assert stats["preemptions"] > 0


def test_requests_admitted_in_the_same_step_share_a_prefix_computed_in_that_step(arch_case):
    """A step writes every new K/V of a layer before any query attends, so a request admitted after
    another in the same step can use the blocks the other is computing (vLLM caches at allocation)."""
    arch, path, refs = arch_case
    with LLM(str(path), dtype=ORACLE_DTYPE, num_kv_blocks=64) as llm:  # fresh: nothing cached before this step
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        steps = llm.stats()["steps"]
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert steps == MAX_NEW  # every prompt was admitted in the first step
    if arch != "mistral":  # (no prefix caching with a sliding window)
        assert outs[2].num_cached_tokens == 0 and outs[3].num_cached_tokens > 0 and outs[4].num_cached_tokens > 0
