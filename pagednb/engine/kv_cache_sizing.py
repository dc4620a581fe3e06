"""How many KV blocks the pool gets, and the refusal to start when one long request cannot fit.

On a GPU (vLLM's rule): gpu_memory_utilization x total memory, minus the weights, minus the peak
activations of a profiling forward pass at max_num_batched_tokens, minus memory others hold, divided by
the bytes of one block. On a CPU there is nothing to profile against, so a plain byte budget is used.

"Weights" are this engine's own parameter bytes. What else this process already holds on the device
(typically an engine of an earlier run of the same notebook cell) is reported apart, naming the other
live pagednb engines (engine/live_engines.py), so the user knows what to close().
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from pagednb.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from pagednb.engine import live_engines
from pagednb.engine.kv_cache_groups import blocks_for_one_request_of
from pagednb.engine.live_engines import format_bytes
from pagednb.engine.model_runner import ModelRunner

logger = logging.getLogger("pagednb")
GiB = 2**30


@dataclass(frozen=True)
class GpuMemory:
    """The device memory at start-up, in bytes, as the start-up report gives it."""
    total: int
    weights: int  # this engine's own parameters
    activations: int  # peak of the profiling pass
    other_engines: int  # other live pagednb engines of this process (weights and KV caches)
    other_tensors: int  # the rest this process holds (user tensors, this engine's small buffers)
    other_processes: int
    available: int  # left for the KV cache

    def report(self) -> str:
        return (f"GPU memory: {self.total / GiB:.2f} GiB total, weights {format_bytes(self.weights)}, "
                f"peak activations {format_bytes(self.activations)}, "
                f"other pagednb engines {format_bytes(self.other_engines)}, "
                f"other tensors of this process {format_bytes(self.other_tensors)}, "
                f"other processes {format_bytes(self.other_processes)}, "
                f"{format_bytes(self.available)} left for the KV cache")


@dataclass
class PoolPlan:
    num_blocks: int
    block_size: int
    max_model_len: int
    blocks_per_max_request: int
    source: str
    gpu_memory: GpuMemory | None = None  # the profile the size came from (GPU sizing only)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        return self.num_blocks / self.blocks_per_max_request


def plan_kv_pool(config: EngineConfig, runner: ModelRunner, max_model_len: int, max_num_batched_tokens: int,
                 max_num_seqs: int) -> PoolPlan:
    block_size = config.block_size
    needed = blocks_for_one_request_of(runner.layout, max_model_len, block_size, max_num_batched_tokens)
    # More blocks than max_num_seqs full-length requests can ever use would only cost memory.
    useful = max_num_seqs * needed
    gpu_memory = None
    if config.num_kv_blocks is not None:
        num_blocks, source = config.num_kv_blocks, "num_kv_blocks"
    elif runner.device.type == "cuda":
        gpu_memory = _profile_gpu_memory(config, runner, max_model_len, max_num_batched_tokens)
        if runner.tensor_parallel is not None:  # one pool size for every rank: what the least of them affords
            gpu_memory = replace(gpu_memory, available=runner.tensor_parallel.min_over_ranks(gpu_memory.available))
        logger.info("%s", gpu_memory.report())
        num_blocks, source = _cap(gpu_memory.available // runner.block_bytes(), useful, max_num_seqs,
                                  f"gpu_memory_utilization={config.gpu_memory_utilization}")
    else:
        budget = config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
        num_blocks, source = _cap(budget // runner.block_bytes(), useful, max_num_seqs,
                                  f"kv_cache_memory={budget / GiB:.2f} GiB")
    plan = PoolPlan(int(num_blocks), block_size, max_model_len, needed, source, gpu_memory)
    others = live_engines.describe(live_engines.on_device(runner.device))
    _refuse_if_too_small(plan, runner, max_num_batched_tokens, others)
    logger.info("KV cache: %d tokens (%d blocks of %d, %s in %s, from %s); max concurrency %.2fx at "
                "max_model_len=%d", plan.num_tokens, plan.num_blocks, block_size,
                format_bytes(plan.num_blocks * runner.block_bytes()), str(runner.kv_cache_dtype).removeprefix("torch."),
                source, plan.max_concurrency, max_model_len)
    if runner.layout.is_hybrid:
        logger.info("Hybrid KV cache: %s", describe_hybrid_saving(plan, runner))
    if others:
        logger.info("Note: %s", others)
    return plan


def _cap(affordable: int, useful: int, max_num_seqs: int, source: str) -> tuple[int, str]:
    """The blocks the budget affords, capped at what max_num_seqs full-length requests can use; the
    source says which limit won, so a pool smaller than its memory budget explains itself."""
    if affordable <= useful:
        return affordable, source
    return useful, (f"{source}, capped at max_num_seqs={max_num_seqs} x one max_model_len request, "
                    f"as more could never be used")


def describe_hybrid_saving(plan: PoolPlan, runner: ModelRunner) -> str:
    """The layer groups, and the max_model_len requests the same memory would hold with every layer's K/V
    in each block (the uniform layout): the saving of freeing sliding layers' blocks outside their window."""
    layout = runner.layout
    windows = ", ".join(f"{sum(g.window == w for g in layout.groups)} x {'full' if w is None else f'window {w}'}"
                        for w in dict.fromkeys(layout.windows))
    uniform_blocks = plan.num_blocks * layout.layers_per_block // runner.spec.num_layers
    uniform = uniform_blocks / -(-plan.max_model_len // plan.block_size)
    return (f"{len(layout.groups)} groups of {layout.layers_per_block} layers ({windows}) share the pool; "
            f"max concurrency {plan.max_concurrency:.2f}x at max_model_len={plan.max_model_len} "
            f"vs {uniform:.2f}x with every layer in each block")


def _profile_gpu_memory(config: EngineConfig, runner: ModelRunner, max_model_len: int,
                        max_num_batched_tokens: int) -> GpuMemory:
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()
    # Everything this process holds on the device now: this engine's weights, and whatever earlier
    # engines and user tensors hold. Weights are counted on the tensors, never as this difference.
    baseline = torch.cuda.memory_allocated(runner.device)
    weights = live_engines.parameter_bytes(runner.model)
    other_engines = sum(e.total_bytes for e in live_engines.on_device(runner.device))
    torch.cuda.reset_peak_memory_stats(runner.device)
    scratch = runner.profile_run(max_num_batched_tokens, max_model_len)
    torch.cuda.synchronize(runner.device)
    activations = max(torch.cuda.max_memory_allocated(runner.device) - baseline - scratch, 0)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    other_processes = max(total - free - torch.cuda.memory_reserved(runner.device), 0)
    available = config.gpu_memory_utilization * total - baseline - activations - other_processes
    return GpuMemory(total, weights, activations, other_engines, max(baseline - weights - other_engines, 0),
                     other_processes, max(int(available), 0))


def _refuse_if_too_small(plan: PoolPlan, runner: ModelRunner, max_num_batched_tokens: int, others: str = "") -> None:
    """`others`: the other live engines' description (live_engines.describe), "" when there are none."""
    if plan.num_blocks >= plan.blocks_per_max_request:
        return
    fits, too_long = 0, plan.max_model_len  # the longest request the pool holds, by bisection
    while too_long - fits > 1:
        mid = (fits + too_long) // 2
        needed = blocks_for_one_request_of(runner.layout, mid, plan.block_size, max_num_batched_tokens)
        fits, too_long = (mid, too_long) if needed <= plan.num_blocks else (fits, mid)
    largest = fits
    close_others = f" Or free memory: {others}." if others else ""
    raise ValueError(
        f"The KV cache has room for {plan.num_tokens} tokens ({plan.num_blocks} blocks of {plan.block_size}, "
        f"from {plan.source}, {runner.block_bytes()} bytes per block), but one request of "
        f"max_model_len={plan.max_model_len} needs {plan.blocks_per_max_request} blocks. Lower max_model_len "
        f"(at most {largest} fits), or give the cache more memory: raise gpu_memory_utilization (GPU), "
        f"kv_cache_memory (CPU) or num_kv_blocks, or lower max_num_batched_tokens to shrink the activations."
        + close_others)
