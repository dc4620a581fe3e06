"""The hybrid KV cache (engine/kv_cache_groups.py, engine/hybrid_kv_cache_manager.py): a tiny Qwen2 whose
layers mix a 16-token sliding window and full attention. Greedy outputs equal HF transformers' with prompts
longer than the window, chunked prefill, prefix hits and preemption; the sliding groups free their blocks
outside the window; the pool holds more max_model_len requests than the uniform layout at the same memory."""
import pytest
import torch
from gpu_support import gpu
from test_scheduler import run_step
from tiny import hf_greedy, make_tiny_model

from pagednb import LLM, SamplingParams
from pagednb.engine.kv_cache_groups import KVCacheGroup, layers_per_block, plan_kv_cache_layout

WINDOW = 16
BLOCK = 8
LAYER_TYPES = ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
               "full_attention", "sliding_attention")  # 4 sliding, 2 full: groups of 2 layers
MAX_NEW = 20
LONG = "Paged attention stores the key value cache in fixed blocks of tokens. "
PROMPTS = [
    LONG + "Continuous batching lets new requests join",
    LONG + "Unicode text: café",
    "The dog",
    LONG * 2 + "Numbers 0 1 2",
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(model dir, the HF reference continuation of every prompt)."""
    path = make_tiny_model(tmp_path_factory.mktemp("hybrid"), "qwen2", num_hidden_layers=len(LAYER_TYPES),
                           use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
                           layer_types=list(LAYER_TYPES))
    return path, hf_greedy(path, PROMPTS, MAX_NEW)


def run(path, prompts=PROMPTS, **engine_args):
    """Generates step by step, checking the pool's integrity after every step; returns outputs, stats and
    the blocks each request held in its last step (decoding, its prompt long computed)."""
    args = dict(dtype="float32", block_size=BLOCK) | engine_args
    with LLM(str(path), **args) as llm:
        engine = llm.engine
        assert engine.runner.layout.is_hybrid
        ids = [engine.add_request(None, p, GREEDY) for p in prompts]
        finals, last_held = {}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            engine.check_integrity()
            for rid in ids:
                last_held[rid] = engine.kv_cache_manager.num_blocks_held(rid) or last_held.get(rid, 0)
        stats = llm.stats()
        assert stats["used_blocks"] == 0
    return [finals[rid].outputs[0].token_ids for rid in ids], stats, [last_held[rid] for rid in ids], finals, ids


def test_layout_groups_layers_by_attention_type():
    layout = plan_kv_cache_layout(tuple(WINDOW if t == "sliding_attention" else None for t in LAYER_TYPES))
    assert layout.layers_per_block == 2
    assert [(g.window, g.layers) for g in layout.groups] == [(WINDOW, (0, 2)), (WINDOW, (3, 5)), (None, (1, 4))]
    assert layout.layer_group == (0, 2, 0, 1, 2, 1) and layout.layer_tensor == (0, 0, 1, 0, 1, 1)
    for windows in ((None,) * 3, (16,) * 3):  # uniform models keep one group, one tensor per layer
        uniform = plan_kv_cache_layout(windows)
        assert not uniform.is_hybrid and uniform.layers_per_block == 3 and uniform.layer_tensor == (0, 1, 2)


def test_many_small_groups_merge_into_fewer_with_little_padding():
    """Gemma-3-1B's pattern (every 6th of 26 layers full): 13 groups of 2 layers would cost the host 13 block
    lists and tables per request; blocks of 4 layers make 6 sliding groups (the last one 2 layers, padded) and
    1 full group, with no full-attention layer padded."""
    layout = plan_kv_cache_layout(tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26)))
    assert layout.layers_per_block == 4 and len(layout.groups) == 7
    assert [len(g.layers) for g in layout.groups] == [4, 4, 4, 4, 4, 2, 4]
    assert layout.groups[-1] == KVCacheGroup(None, (5, 11, 17, 23))
    for layer in range(26):  # each layer in its group's tensor j, no two layers of a group sharing one
        group = layout.groups[layout.layer_group[layer]]
        assert group.layers[layout.layer_tensor[layer]] == layer
    assert plan_kv_cache_layout((512, None) * 13).layers_per_block == 13  # Gemma 2: 2 groups, as before
    # padding a type by more than an eighth of its layers is not worth it: 4 sliding + 2 full stays at 2
    assert layers_per_block([4, 2]) == 2 and layers_per_block([9, 4]) == 2 and layers_per_block([52, 10]) == 11


def test_a_padded_group_matches_hf(tmp_path):
    """9 sliding and 4 full layers: blocks of 2 layers, the fifth sliding group 1 layer padded to 2."""
    layer_types = ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(13)]
    path = make_tiny_model(tmp_path / "padded", "qwen2", num_hidden_layers=len(layer_types), use_sliding_window=True,
                           sliding_window=WINDOW, max_window_layers=0, layer_types=layer_types)
    layout = plan_kv_cache_layout(tuple(WINDOW if t == "sliding_attention" else None for t in layer_types))
    assert layout.layers_per_block == 2 and [len(g.layers) for g in layout.groups] == [2, 2, 2, 2, 1, 2, 2]
    got, _, _, _, _ = run(path, PROMPTS[:2], num_kv_blocks=128, max_model_len=128, max_num_batched_tokens=16)
    assert got == hf_greedy(path, PROMPTS[:2], MAX_NEW)


def test_outputs_match_hf_with_prompts_longer_than_the_window(case):
    path, refs = case
    got, _, last_held, finals, ids = run(path, num_kv_blocks=256)
    assert got == refs
    long_len = len(finals[ids[3]].prompt_token_ids) + MAX_NEW
    assert long_len > 4 * WINDOW
    # the full group holds every block of the sequence, each of the 2 sliding groups only its window's
    full, window_blocks = -(-long_len // BLOCK), WINDOW // BLOCK + 1
    assert last_held[3] <= full + 2 * window_blocks < 3 * full


def test_chunked_prefill_and_asynchronous_scheduling_match_hf(case):
    path, refs = case
    got, _, _, _, _ = run(path, num_kv_blocks=256, max_num_batched_tokens=5)
    assert got == refs
    got, _, _, _, _ = run(path, num_kv_blocks=256, max_num_batched_tokens=7, async_scheduling=True)
    assert got == refs


def test_a_pool_too_small_for_everyone_preempts_and_still_matches(case):
    path, refs = case
    got, stats, _, _, _ = run(path, num_kv_blocks=26, max_model_len=96, max_num_batched_tokens=16)
    assert got == refs
    assert stats["preemptions"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_hits_span_every_group_and_keep_outputs(case, async_scheduling):
    """The same long prompts again: the hit covers blocks of the full group AND the sliding groups' window
    before the hit point (their released blocks stay cached; with asynchronous scheduling too, where the
    next step is scheduled before a prompt's blocks are committed), and the outputs do not change."""
    path, refs = case
    with LLM(str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=512,
             async_scheduling=async_scheduling) as llm:
        first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.engine.check_integrity()
        stats = llm.stats()
        block_map = llm.block_map()  # the notebook's pool view: every block, whichever group holds it
    assert len(block_map) == 512 and {state for state, _ in block_map} <= {"free", "cached"}
    assert sum(state == "cached" for state, _ in block_map) == stats["cached_blocks"] > 0
    assert [o.outputs[0].token_ids for o in first] == refs == [o.outputs[0].token_ids for o in again]
    assert again[3].num_cached_tokens > 3 * WINDOW  # far past the window: sliding blocks were hit too
    assert stats["prefix_cache_hit_tokens"] > 0


def test_a_hit_is_capped_where_a_sliding_group_lost_its_blocks(case, monkeypatch):
    """A small pool reuses the first request's released sliding blocks (freed first, so evicted first); a
    later identical prompt then hits only as far as every group still has its chain, though the full group
    has all of it, and its output still equals HF's."""
    path, refs = case
    with LLM(str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=64, max_model_len=96,
             max_num_batched_tokens=16) as llm:
        llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)
        llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
        chains = {}
        for i, group in enumerate(llm.engine.kv_cache_manager.groups):
            def record(req, find=group.find_prefix_hit, i=i):
                hit = find(req)
                chains[i] = len(hit.blocks)
                return hit
            monkeypatch.setattr(group, "find_prefix_hit", record)
        out = llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)[0]
        llm.engine.check_integrity()
    assert out.outputs[0].token_ids == refs[3]
    full_chain = chains[2] * BLOCK  # group 2 holds the full-attention layers
    assert full_chain == len(out.prompt_token_ids) // BLOCK * BLOCK
    assert out.num_cached_tokens == min(chains.values()) * BLOCK < full_chain


def test_the_pool_holds_more_long_requests_than_the_uniform_layout(case, tiny_model_dir):
    path, _ = case
    uniform_path = tiny_model_dir("qwen2", num_hidden_layers=len(LAYER_TYPES))  # every layer full
    memory, max_len = 2**20, 256
    plans = {}
    for name, p in (("hybrid", path), ("uniform", uniform_path)):
        with LLM(str(p), dtype="float32", block_size=BLOCK, kv_cache_memory=memory, max_model_len=max_len,
                 max_num_batched_tokens=16, device="cpu") as llm:  # kv_cache_memory sizes a CPU pool
            plan, runner = llm.engine.pool_plan, llm.engine.runner
            assert sum(t.nbytes for t in runner.kv_cache_tensors) == plan.num_blocks * runner.block_bytes() <= memory
            plans[name] = plan
    # a long request: 1 full group of max_len / BLOCK blocks plus 2 sliding groups of their window (+ chunk)
    assert plans["hybrid"].max_concurrency > 2 * plans["uniform"].max_concurrency


def test_the_start_up_estimate_counts_a_block_as_one_groups_layers(case):
    """A hybrid block id spans one layer group's layers, not all of them: the memory estimate made before
    loading (model/spec.py) counts the pool the engine then allocates, so num_kv_blocks is not refused for
    ~num_groups times the memory it takes."""
    from pagednb.config import EngineConfig
    from pagednb.model.spec import check_start_up_memory, device_memory, estimate_bytes

    path, _ = case
    with LLM(str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=256, device="cpu") as llm:
        engine, runner = llm.engine, llm.engine.runner
        parts = estimate_bytes(engine.spec, torch.float32, block_size=BLOCK, max_model_len=engine.max_model_len,
                               max_num_seqs=engine.config.max_num_seqs,
                               max_num_batched_tokens=engine.max_num_batched_tokens, num_kv_blocks=256,
                               kv_block_bytes=runner.block_bytes())
        assert parts["KV cache"] == sum(t.nbytes for t in runner.kv_cache_tensors)
        # the most blocks the host's memory holds by the estimate: accepted, where counting every layer per
        # block (the old estimate) refused it
        affordable = device_memory(torch.device("cpu"))[0] // runner.block_bytes() * 9 // 10
        big = EngineConfig(str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=affordable)
        big.validate()
        check_start_up_memory(engine.spec, big, torch.float32, torch.device("cpu"), engine.max_model_len,
                              engine.max_num_batched_tokens)


def test_a_layer_groups_cuda_plan_is_the_steps_with_its_own_block_table():
    """The CUDA backend plans a step once: a layer group's metadata reuses that plan (batch, row plans) and
    swaps in its own block table. (The planning is host code: it runs on a CPU too.)"""
    import torch

    from pagednb.attention.backend import AttentionMetadata
    from pagednb.attention.cuda_backend import _plan_of

    qsl, lens = torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32)
    step = AttentionMetadata(torch.zeros(4, dtype=torch.int64), qsl, lens, torch.zeros(2, 3, dtype=torch.int32),
                             3, 9, [0, 1, 4], [5, 9])
    tables = torch.arange(6, dtype=torch.int32).view(2, 3)
    group = AttentionMetadata(torch.ones(4, dtype=torch.int64), qsl, lens, tables, 3, 9, [0, 1, 4], [5, 9], base=step)
    plan = _plan_of(group)
    assert plan.block_tables is tables and plan.row_plans is step._cuda_plan.row_plans
    assert (plan.num_decode, plan.max_query_len, plan.rows) == (1, 3, 4)
    assert step._cuda_plan.block_tables is step.block_tables


@gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_kernels_and_cuda_graphs_match_hf(case, enforce_eager):
    """float32 on the GPU (exact): the CUDA kernels read each group's block table, the decode graphs
    each group's static table; chunked prefill, asynchronous scheduling and prefix hits included."""
    path, _ = case
    refs = hf_greedy(path, PROMPTS, MAX_NEW, device="cuda")
    with LLM(str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=256, max_num_batched_tokens=16,
             enforce_eager=enforce_eager) as llm:
        assert llm.engine.attention_backend.name == "cuda"
        first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.engine.check_integrity()
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == enforce_eager and (enforce_eager or graphs.num_replays > 0)
    assert [o.outputs[0].token_ids for o in first] == refs == [o.outputs[0].token_ids for o in again]
    assert again[3].num_cached_tokens > 3 * WINDOW


# ---- the manager and the scheduler, without a model ---------------------------------------------------
def hybrid_scheduler(num_blocks=64, budget=32, max_seqs=8, windows=(8, None, 8), max_len=128):
    from pagednb.engine.block_pool import BlockPool
    from pagednb.engine.hybrid_kv_cache_manager import HybridKVCacheManager
    from pagednb.engine.scheduler import Scheduler

    return Scheduler(HybridKVCacheManager(BlockPool(num_blocks, True), 4, list(windows)), max_seqs, budget, max_len)


def model_free_request(i, prompt, max_tokens=6):
    from pagednb.request import Request

    return Request(f"m{i}", list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens,
                   arrival_index=i)


def test_a_tight_pool_preempts_counting_every_group_and_every_request_finishes():
    sched = hybrid_scheduler(num_blocks=30, budget=12)
    reqs = [model_free_request(i, [3 + (i * 5 + j) % 40 for j in range(10 + 6 * i)], max_tokens=8) for i in range(5)]
    for req in reqs:
        sched.add_request(req)
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        run_step(sched)
        for req in sched.running:  # sliding groups (0 and 2) hold only the blocks of their window
            held = [len([b for b in g._reqs[req.request_id].blocks if b is not None]) for g in sched.kv.groups]
            assert held[0] == held[2] <= 8 // 4 + 1 + 12 // 4 and held[1] == -(-req.num_computed_tokens // 4)
    assert not sched.has_unfinished_requests() and sched.num_preemptions > 0
    assert all(len(r.output_token_ids) == 8 for r in reqs)
    assert sched.kv.pool.num_free_blocks == 30


def test_every_group_stays_in_lockstep_through_prefix_hits_and_preemptions():
    """The manager asks group 0 alone whether a decode step needs a block or has one to cache: that holds only
    while every group's block list has the same length and the same number of cached blocks."""
    sched = hybrid_scheduler(num_blocks=40, budget=12, windows=(8, None, 8, None))
    shared = [3 + j % 40 for j in range(14)]
    reqs = [model_free_request(i, shared + [5 + i] * (3 + 4 * i), max_tokens=10) for i in range(6)]
    for req in reqs:
        sched.add_request(req)
    while sched.has_unfinished_requests():
        run_step(sched)
        for req in sched.running:
            states = [group._reqs[req.request_id] for group in sched.kv.groups]
            assert len({len(state.blocks) for state in states}) == 1
            assert len({state.num_cached for state in states}) == 1
    assert sched.num_preemptions > 0 and sched.kv.prefix_cache_hit_tokens > 0
    assert all(len(r.output_token_ids) == 10 for r in reqs)


def test_a_failed_request_leaves_no_block_of_any_group_to_hit():
    from pagednb.engine.sampler import INVALID_TOKEN_ID

    prompt = [3 + j % 40 for j in range(30)]
    sched = hybrid_scheduler()
    sched.add_request(model_free_request(0, prompt, max_tokens=8))
    run_step(sched)  # the whole prompt
    for _ in range(3):  # decode until its next block: its sliding groups then release what left their window
        run_step(sched)
        if sched.kv.groups[0]._reqs["m0"].released:
            break
    released = [len(g._reqs["m0"].released) for g in sched.kv.groups]
    assert released[1] == 0 and released[0] == released[2] >= 5, released
    run_step(sched, token=INVALID_TOKEN_ID)  # its logits went NaN: it ends with an error
    assert not sched.has_unfinished_requests()
    again = model_free_request(1, prompt)
    assert [len(group.find_prefix_hit(again).blocks) for group in sched.kv.groups] == [0, 0, 0]  # each chain
    sched.add_request(model_free_request(2, prompt[:12] + [1] * 18))  # a healthy run of the same start
    while sched.has_unfinished_requests():
        run_step(sched)
    hit = sched.kv.find_prefix_hit(model_free_request(3, prompt[:12] + [1] * 18))
    assert [len(h.blocks) for h in hit.group_hits] == [7, 7, 7] and hit.num_tokens == 28
