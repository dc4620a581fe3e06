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
