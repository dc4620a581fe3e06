"""How many KV blocks the pool gets, and the refusal to start when one long request cannot fit.

On a GPU (vLLM's rule): gpu_memory_utilization x total memory, minus the weights, minus the peak
activations of a profiling forward pass at max_num_batched_tokens, minus memory others hold, divided by
the bytes of one block. On a CPU there is nothing to profile against, so a plain byte budget is used.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagednb.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from pagednb.engine.model_runner import ModelRunner

logger = logging.getLogger("pagednb")
GiB = 2**30


@dataclass
class PoolPlan:
    num_blocks: int
    block_size: int
    max_model_len: int
    blocks_per_max_request: int
    source: str

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        return self.num_blocks / self.blocks_per_max_request


def plan_kv_pool(config: EngineConfig, runner: ModelRunner, max_model_len: int, max_num_batched_tokens: int,
                 max_num_seqs: int) -> PoolPlan:
    block_size = config.block_size
    needed = blocks_for_one_request(max_model_len, block_size, runner.spec.sliding_window, max_num_batched_tokens)
    # More blocks than max_num_seqs full-length requests can ever use would only cost memory.
    useful = max_num_seqs * needed
    if config.num_kv_blocks is not None:
        num_blocks, source = config.num_kv_blocks, "num_kv_blocks"
    elif runner.device.type == "cuda":
        num_blocks = min(_blocks_from_gpu_profile(config, runner, max_model_len, max_num_batched_tokens), useful)
        source = f"gpu_memory_utilization={config.gpu_memory_utilization}"
    else:
        budget = config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
        num_blocks = min(budget // runner.block_bytes(), useful)
        source = f"kv_cache_memory={budget / GiB:.2f} GiB"
    plan = PoolPlan(int(num_blocks), block_size, max_model_len, needed, source)
    _refuse_if_too_small(plan, runner)
    logger.info("KV cache: %d tokens (%d blocks of %d, %.2f GiB, from %s); max concurrency %.2fx at "
                "max_model_len=%d", plan.num_tokens, plan.num_blocks, block_size,
                plan.num_blocks * runner.block_bytes() / GiB, source, plan.max_concurrency, max_model_len)
    return plan


def blocks_for_one_request(max_model_len: int, block_size: int, sliding_window: int | None,
                           max_num_batched_tokens: int) -> int:
    """Blocks one max_model_len request holds at its peak (a sliding window caps what it keeps)."""
    tokens = max_model_len
    if sliding_window is not None:
        tokens = min(max_model_len, sliding_window + max_num_batched_tokens)
    return -(-tokens // block_size) + (1 if sliding_window is not None else 0)


def _blocks_from_gpu_profile(config: EngineConfig, runner: ModelRunner, max_model_len: int,
                             max_num_batched_tokens: int) -> int:
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    scratch = runner.profile_run(max_num_batched_tokens, max_model_len)
    torch.cuda.synchronize(runner.device)
    activations = torch.cuda.max_memory_allocated(runner.device) - weights - scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    held_by_others = total - free - torch.cuda.memory_reserved(runner.device)
    available = config.gpu_memory_utilization * total - weights - activations - held_by_others
    logger.info("GPU memory: %.2f GiB total, weights %.2f GiB, peak activations %.2f GiB, others %.2f GiB, "
                "%.2f GiB left for the KV cache", total / GiB, weights / GiB, activations / GiB,
                held_by_others / GiB, max(available, 0) / GiB)
    return max(int(available // runner.block_bytes()), 0)


def _refuse_if_too_small(plan: PoolPlan, runner: ModelRunner) -> None:
    if plan.num_blocks >= plan.blocks_per_max_request:
        return
    largest = plan.num_blocks * plan.block_size
    raise ValueError(
        f"The KV cache has room for {plan.num_tokens} tokens ({plan.num_blocks} blocks of {plan.block_size}, "
        f"from {plan.source}, {runner.block_bytes()} bytes per block), but one request of "
        f"max_model_len={plan.max_model_len} needs {plan.blocks_per_max_request} blocks. Lower max_model_len "
        f"(at most {largest} fits), or give the cache more memory: raise gpu_memory_utilization (GPU), "
        f"kv_cache_memory (CPU) or num_kv_blocks, or lower max_num_batched_tokens to shrink the activations.")
