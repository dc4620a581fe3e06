"""Property tests of the whole engine on a tiny model and a tiny pool: random interleavings of
add / step / abort keep every block free xor referenced with exact ref counts, lose no request, leak
no block, and every greedy output equals the same request run alone (preemption and prefix hits
included)."""
import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagednb import LLM, SamplingParams

PROMPT_POOL = [list(range(3, 3 + n)) for n in (1, 5, 16, 17, 33)] + [[7] * 20, [7] * 20 + [9, 10]]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def small_llm(tiny_model_dir, request):
    """Asynchronous scheduling (the next step scheduled before this one's tokens are known) must keep
    every property too."""
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=10, max_model_len=64, max_num_batched_tokens=24,
              max_num_seqs=4, scheduling_policy="priority", async_scheduling=request.param)
    yield llm
    llm.close()


@functools.lru_cache(maxsize=None)
def alone(llm, prompt: tuple, max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(list(prompt), params, use_tqdm=False)[0].outputs[0].token_ids


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "abort"]),
                              st.integers(0, len(PROMPT_POOL) - 1), st.integers(1, 20), st.integers(0, 2)),
                    min_size=1, max_size=40))
def test_random_add_step_abort_interleavings(small_llm, ops):
    engine = small_llm.engine
    submitted, aborted, finals = {}, set(), {}

    def step():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
        engine.check_integrity()

    for op, which, max_tokens, priority in ops:
        if op == "add":
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            rid = engine.add_request(None, PROMPT_POOL[which], params, priority)
            submitted[rid] = (tuple(PROMPT_POOL[which]), max_tokens)
        elif op == "abort" and submitted:
            rid = list(submitted)[which % len(submitted)]
            engine.abort_request(rid)
            aborted.add(rid)
        else:
            step()
    while engine.has_unfinished_requests():
        step()
    assert set(finals) == set(submitted)  # nothing lost: each ended with an output
    for rid, out in finals.items():
        reason = out.outputs[0].finish_reason
        if reason == "abort":
            assert rid in aborted
            continue
        assert reason == "length"
        assert out.outputs[0].token_ids == alone(small_llm, *submitted[rid])
    stats = small_llm.stats()
    assert stats["used_blocks"] == 0 and stats["running"] == stats["waiting"] == 0


def test_preemption_really_happens_in_this_setup(small_llm):
    before = small_llm.stats()["preemptions"]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    which = (4, 4, 3, 2)  # 4 + 4 + 3 + 3 blocks at the end, in a pool of 10
    outs = small_llm.generate([PROMPT_POOL[i] for i in which], params, use_tqdm=False)
    assert small_llm.stats()["preemptions"] > before
    assert [o.outputs[0].token_ids for o in outs] == [alone(small_llm, tuple(PROMPT_POOL[i]), 30) for i in which]


def test_colliding_block_hashes_never_leak_another_prompts_cache(tiny_model_dir, monkeypatch):
    """With every block hash equal, hits still require the same tokens after the same prefix."""
    path = str(tiny_model_dir("llama"))
    prompts = [[5] * 16 + [6] * 16 + [8, 9], [4] * 16 + [6] * 16 + [8, 9], [5] * 16 + [7] * 16 + [8, 9]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(path, num_kv_blocks=32, max_model_len=64) as honest:
        expected = [honest.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    with LLM(path, num_kv_blocks=32, max_model_len=64) as llm:
        llm.engine.kv_cache_manager.pool.hash_fn = lambda parent, tokens: 0
        got = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in got] == expected
    assert [o.num_cached_tokens for o in got] == [0, 0, 16]  # only the truly shared first block hits
