"""The engine on a CUDA GPU: the "auto" dtype and the profiling rule that sizes the pool, and greedy
outputs equal to HF transformers on the same tiny models (float32, so equality is exact)."""
import logging

import pytest
import torch
from tiny import hf_greedy

from pagednb import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; runs on the H200 device")
PROMPTS = ["Once upon a time there was a cat", "The dog", "Paged attention stores the key value cache " * 3]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_gpu_greedy_matches_hf(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    refs = hf_greedy(path, PROMPTS, 24, device="cuda")
    with LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16) as llm:
        assert llm.engine.device.type == "cuda"
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_eager_steps_run_the_lm_head_at_bucket_sizes_and_sample_only_their_own_rows(tiny_model_dir):
    """Prompts of 5 requests prefill in eager steps; the LM head's rows are padded to 8 (DecodeGraphs.rows_bucket:
    few cuBLAS shapes) and the outputs stay HF's."""
    path = tiny_model_dir("qwen3")
    prompts = [f"Story {i}: once upon a time" for i in range(5)]
    refs = hf_greedy(path, prompts, 12, device="cuda")
    with LLM(str(path), dtype="float32", num_kv_blocks=64) as llm:
        model = llm.engine.runner.model
        real, rows = model.compute_logits, []
        model.compute_logits = lambda hidden: (rows.append(hidden.shape[0]), real(hidden))[1]
        try:
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
        finally:
            model.compute_logits = real
    assert rows and all(n == 8 for n in rows), rows  # the graphs' own logits are not computed here
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_auto_dtype_is_bfloat16_and_the_pool_is_sized_by_profiling(tiny_model_dir, caplog):
    # 16 layers x 8 kv heads x 32: 256 KiB per block, so the budget, not max_num_seqs, bounds the pool
    path = tiny_model_dir("llama", num_hidden_layers=16, hidden_size=256, num_attention_heads=8, num_key_value_heads=8)
    with caplog.at_level(logging.INFO, logger="pagednb"):
        llm = LLM(str(path), gpu_memory_utilization=0.02, max_num_batched_tokens=4096, max_num_seqs=1024)
    try:
        assert llm.engine.dtype == torch.bfloat16
        free, total = torch.cuda.mem_get_info()
        budget = 0.02 * total
        pool_bytes = llm.engine.pool_plan.num_blocks * llm.engine.runner.block_bytes()
        assert 0.5 * budget < pool_bytes <= budget  # most of the budget, never more
        assert "peak activations" in caplog.text and "KV cache:" in caplog.text
        out = llm.generate("The cat", GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 24
    finally:
        llm.close()
    assert llm.engine.runner.kv_caches == []


def test_refuses_to_start_when_one_request_cannot_fit(tiny_model_dir):
    with pytest.raises(ValueError, match="max_model_len=512 needs 32 blocks"):
        LLM(str(tiny_model_dir("llama")), gpu_memory_utilization=1e-7)


def test_close_gives_the_model_and_kv_pool_memory_back(tiny_model_dir):
    import asyncio
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=4096)
    held = torch.cuda.memory_allocated() - before
    assert held > 4096 * llm.engine.runner.block_bytes() * 0.99  # the pool really is on the GPU

    async def stream_then_close():
        stream = llm.stream("The cat", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        llm.close()  # mid-stream
        return [out async for out in stream]
    rest = asyncio.run(stream_then_close())
    assert rest[-1].outputs[0].finish_reason == "abort"
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 * 2**20  # everything given back but crumbs


def _streamed_engine_on_an_open_loop(path, blocks: int):
    """An engine that streamed on a loop which then stopped but stays open (its loop task waits there),
    with the GPU memory it holds."""
    import asyncio
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    llm = LLM(str(path), num_kv_blocks=blocks)
    assert torch.cuda.memory_allocated() - before > blocks * llm.engine.runner.block_bytes() * 0.99

    async def consume():
        async for _ in llm.stream("The cat", GREEDY):
            pass
    loop = asyncio.new_event_loop()
    loop.run_until_complete(consume())
    return llm, loop, before


def test_del_gives_the_gpu_memory_back(tiny_model_dir, caplog):
    llm, loop, before = _streamed_engine_on_an_open_loop(tiny_model_dir("llama"), 4096)
    del llm  # neither close() nor gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 * 2**20
    loop.close()
    assert "Task was destroyed but it is pending" not in caplog.text


def test_close_of_a_dropped_but_referenced_engine_gives_the_gpu_memory_back(tiny_model_dir):
    llm, loop, before = _streamed_engine_on_an_open_loop(tiny_model_dir("llama"), 4096)
    history = {"Out": llm}  # a re-run cell rebinds `llm`; the notebook's output history keeps the old one
    llm = None
    history["Out"].close()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 * 2**20
    loop.close()


# ---- CUDA graphs for decode steps ----------------------------------------------------------------------
# Five prompts of different lengths and budgets: the batch starts in the bucket of 8 (three padding rows)
# and shrinks through the buckets of 4, 2 and 1 as requests finish.
GRAPH_PROMPTS = PROMPTS + ["A fox", "Tell me a story about a cat named Tom and a dog named Max, please"]
GRAPH_BUDGETS = [40, 8, 24, 3, 17]


def _run(path, dtype, enforce_eager, params, **kwargs):
    with LLM(str(path), dtype=dtype, num_kv_blocks=96, max_num_batched_tokens=64, max_num_seqs=8,
             enforce_eager=enforce_eager, **kwargs) as llm:
        assert llm.engine.async_scheduling is kwargs.get("async_scheduling", True)  # the GPU default
        assert llm.engine.uses_cuda_graphs == (not enforce_eager)
        outs = llm.generate(GRAPH_PROMPTS, params, use_tqdm=False)
        replays = llm.engine.runner.graphs.num_replays if llm.engine.runner.graphs is not None else 0
    return [o.outputs[0].token_ids for o in outs], replays


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_outputs_with_and_without_cuda_graphs_are_identical_and_equal_hf(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in GRAPH_BUDGETS]
    refs = [ref[:n] for ref, n in zip(hf_greedy(path, GRAPH_PROMPTS, max(GRAPH_BUDGETS), device="cuda"),
                                      GRAPH_BUDGETS)]
    graphed, replays = _run(path, "float32", False, params)
    eager, no_replays = _run(path, "float32", True, params)
    synchronous, _ = _run(path, "float32", False, params, async_scheduling=False)
    assert replays > 30 and no_replays == 0  # decode steps really replayed graphs
    assert graphed == eager == synchronous == refs


def test_seeded_sampling_is_the_same_with_and_without_cuda_graphs(tiny_model_dir):
    path = tiny_model_dir("llama")
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=n, seed=i, ignore_eos=True)
              for i, n in enumerate(GRAPH_BUDGETS)]
    graphed, _ = _run(path, "float32", False, params)
    eager, _ = _run(path, "float32", True, params)
    assert graphed == eager


def test_bf16_graphs_agree_with_eager_steps(tiny_model_dir):
    """bf16: the graph plans attention's split for max_model_len, eager steps for the real lengths, so
    sums may round differently; the first tokens still agree (a near-tie may flip one request)."""
    path = tiny_model_dir("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in GRAPH_BUDGETS]
    graphed, _ = _run(path, "bfloat16", False, params)
    eager, _ = _run(path, "bfloat16", True, params)
    agree = sum(a[:3] == b[:3] for a, b in zip(graphed, eager))
    assert agree >= len(GRAPH_PROMPTS) - 1, (graphed, eager)


def test_graph_capture_is_logged_and_covers_every_batch_size(tiny_model_dir, caplog):
    path = tiny_model_dir("llama")
    ref = hf_greedy(path, ["The cat"], 24, device="cuda")[0]
    with caplog.at_level(logging.INFO, logger="pagednb"):
        llm = LLM(str(path), dtype="float32", num_kv_blocks=128, max_num_seqs=40)
    with llm:
        graphs = llm.engine.runner.graphs
        assert graphs.sizes == [1, 2, 4, 8, 16, 32, 40]
        assert "Captured 7 decode CUDA graphs (batch sizes 1-40)" in caplog.text
        outs = llm.generate(["The cat"] * 33, GREEDY, use_tqdm=False)  # 33 rows: the bucket of 40
        assert graphs.num_replays >= 20
    assert all(o.outputs[0].token_ids == ref for o in outs)  # the 7 padding rows wrote nothing


def test_enforce_eager_and_the_reference_backend_capture_nothing(tiny_model_dir):
    with LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, enforce_eager=True) as llm:
        assert llm.engine.runner.graphs is None
    with LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, attention_backend="torch_ref") as llm:
        assert llm.engine.runner.graphs is None and not llm.engine.uses_cuda_graphs


def test_a_re_run_engine_reports_its_own_weights_and_names_the_engine_still_alive(tiny_model_dir, caplog):
    """Re-running `llm = LLM(...)`: the old engine still holds GPU memory while the new one starts. The
    new one's weights are its own (they were the whole process's allocation), the old one is named."""
    import math

    from safetensors import safe_open

    from pagednb.engine.live_engines import format_bytes, memory_of
    first_path, second_path = tiny_model_dir("llama"), tiny_model_dir("qwen3")
    first = LLM(str(first_path), num_kv_blocks=8192)  # tens of MiB, far more than the second's weights
    try:
        with caplog.at_level(logging.INFO, logger="pagednb"):
            second = LLM(str(second_path), gpu_memory_utilization=0.05, max_num_seqs=8)
        with second:
            report = second.engine.pool_plan.gpu_memory
            with safe_open(str(second_path / "model.safetensors"), "pt") as f:  # counted apart from the engine
                stored = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
            own = stored * torch.tensor([], dtype=second.engine.dtype).element_size()
            assert report.weights == pytest.approx(own, rel=0.01)
            held = memory_of(first.engine).total_bytes
            assert held > 20 * own and report.other_engines >= held
            assert f"weights {format_bytes(report.weights)}" in caplog.text
            assert f"{first_path.name}: {format_bytes(held)}" in caplog.text and "close()" in caplog.text
    finally:
        first.close()



def _qwen3_0_6b_shape(tmp_path):
    """The Qwen3-0.6B shape with random bf16 weights, as the benchmarks build it (benchmarks/shapes.py)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "bench_shapes", Path(__file__).resolve().parents[1] / "benchmarks" / "shapes.py")
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    return shapes.make_model_dir("qwen3-0.6b", tmp_path)


def test_sleep_level_1_leaves_under_1_gib_and_wakes_with_the_same_outputs_and_graphs(tmp_path):
    """Sleep mode's promise on the GPU (issue 16): the Qwen3-0.6B shape with its profiled pool and CUDA
    graphs keeps < 1 GiB after sleep(level=1), then wakes to the same greedy tokens through recaptured
    graphs (the old ones held freed addresses)."""
    path = _qwen3_0_6b_shape(tmp_path)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 164 + 7 * i))} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(str(path), gpu_memory_utilization=0.3, max_num_seqs=64) as llm:
        awake = torch.cuda.memory_allocated() - baseline
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.uses_cuda_graphs and llm.engine.runner.graphs.num_replays > 0
        llm.sleep(level=1)
        torch.cuda.synchronize()
        asleep = torch.cuda.memory_allocated() - baseline
        assert asleep < 2**30, f"{asleep / 2**30:.2f} GiB still allocated after sleep(level=1)"
        assert awake > 10 * 2**30  # the weights (1.2 GB) and the pool were really there
        llm.wake_up()
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.num_replays == 0  # recaptured, not the stale ones
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert graphs.num_replays > 0
        assert after == before
        assert torch.cuda.memory_allocated() - baseline == pytest.approx(awake, rel=0.05)


def test_sleep_level_2_reloads_the_weights_on_the_gpu(tiny_model_dir):
    with LLM(str(tiny_model_dir("qwen3", tie_word_embeddings=True)), dtype="float32", num_kv_blocks=64) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        llm.sleep(level=2)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() < held
        assert all(p.numel() == 0 for p in llm.engine.runner.model.parameters())
        llm.wake_up()
        assert all(p.is_cuda and p.dtype == torch.float32 for p in llm.engine.runner.model.parameters())
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == before
