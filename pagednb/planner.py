"""How many users fit: the KV pool's arithmetic for a workload, from the live engine's numbers.

A user of `prompt_tokens + output_tokens` tokens holds ceil(tokens / block_size) blocks at its peak
(paged attention wastes at most the last block's tail). A system prompt of S tokens that every user
shares is stored once when prefix caching is on: its S // block_size full blocks are shared, only the
rest is per user. Concurrency is further capped by max_num_seqs, and a user longer than max_model_len
never fits. The what-ifs (`gpu_memory_utilization`, `kv_cache_memory`, `dtype`, `max_model_len`)
resize the pool by the engine's own rule (engine/kv_cache_sizing.py): the memory budget divided by the
bytes of one block, capped at max_num_seqs requests of max_model_len. In a model mixing sliding-window and
full layers (engine/kv_cache_groups.py) a block holds one layer group, a user holds blocks in every group
(a sliding group only its window's), and a shared prefix is stored once in the full-attention groups.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagednb.config import DEFAULT_CPU_KV_CACHE_MEMORY, _DTYPES
from pagednb.engine.kv_cache_groups import blocks_for_one_request_of
from pagednb.engine.live_engines import format_bytes
from pagednb.validation import as_float, as_int


@dataclass(frozen=True)
class MemoryPlan:
    """The numbers for one workload on one (possibly hypothetical) pool. Every count is in blocks."""

    prompt_tokens: int
    output_tokens: int
    users: int
    shared_prefix_tokens: int
    block_size: int
    num_blocks: int  # the pool (what-ifs applied)
    pool_bytes: int
    kv_bytes_per_token: int
    dtype: str
    max_model_len: int
    max_num_seqs: int
    prefix_caching: bool
    blocks_per_user: int  # without sharing
    shared_blocks: int  # full blocks of the shared prefix, stored once (0 without prefix caching)
    users_fit_unshared: int
    users_fit_shared: int
    limit: str  # what caps users_fit: "KV pool", "max_num_seqs" or "max_model_len"
    bytes_needed: int  # KV bytes for `users` users (sharing counted)
    gpu_memory_utilization_needed: float | None  # to fit `users`, on a GPU (None on a CPU)
    kv_cache_memory_needed: int | None  # to fit `users`, on a CPU (None on a GPU)
    users_fit_by_dtype: dict[str, int]  # the same memory with another KV dtype

    @property
    def users_fit(self) -> int:
        """With the shared prefix stored once (when there is one and prefix caching is on)."""
        return self.users_fit_shared

    @property
    def fits(self) -> bool:
        return self.users <= self.users_fit

    def __str__(self) -> str:
        lines = [f"{self.users} users of {self.prompt_tokens} prompt + {self.output_tokens} output tokens: "
                 f"{'fit' if self.fits else 'do NOT fit'} (up to {self.users_fit}, limited by {self.limit})",
                 f"pool: {self.num_blocks} blocks x {self.block_size} tokens = {format_bytes(self.pool_bytes)} "
                 f"({self.kv_bytes_per_token} bytes/token, {self.dtype})",
                 f"per user: {self.blocks_per_user} blocks; without sharing, {self.users_fit_unshared} users fit"]
        if self.shared_prefix_tokens:
            lines.append(f"shared prefix of {self.shared_prefix_tokens} tokens: {self.shared_blocks} blocks "
                         f"stored once -> {self.users_fit_shared} users fit")
        if self.gpu_memory_utilization_needed is not None:
            lines.append(f"gpu_memory_utilization for {self.users} users: {self.gpu_memory_utilization_needed:.3f}")
        if self.kv_cache_memory_needed is not None:
            lines.append(f"kv_cache_memory for {self.users} users: {format_bytes(self.kv_cache_memory_needed)}")
        lines.append("by KV dtype: " + ", ".join(f"{name} {n}" for name, n in self.users_fit_by_dtype.items()))
        return "\n".join(lines)


def plan(llm, prompt_tokens: int, output_tokens: int, users: int = 1, *, shared_prefix_tokens: int = 0,
         gpu_memory_utilization: float | None = None, kv_cache_memory: int | None = None,
         dtype: str | None = None, max_model_len: int | None = None) -> MemoryPlan:
    """How many users of `prompt_tokens + output_tokens` fit in `llm`'s KV pool, with and without a
    shared prefix of `shared_prefix_tokens` (part of the prompt), and what it takes to fit `users`.

    The keyword what-ifs recompute the pool as the engine would size it with that setting."""
    engine = llm.engine
    config = engine.config
    prompt_tokens = as_int("prompt_tokens", prompt_tokens, "an int >= 1", 1)
    output_tokens = as_int("output_tokens", output_tokens, "an int >= 1", 1)
    users = as_int("users", users, "an int >= 1", 1)
    shared_prefix_tokens = as_int("shared_prefix_tokens", shared_prefix_tokens,
                                  f"an int in [0, prompt_tokens={prompt_tokens}]", 0, prompt_tokens)
    max_model_len = engine.max_model_len if max_model_len is None else as_int(
        "max_model_len", max_model_len, f"an int in [1, {engine.spec.max_position_embeddings}]", 1,
        engine.spec.max_position_embeddings)
    kv_dtype = engine.runner.kv_cache_dtype if dtype is None else _dtype(dtype)
    bytes_per_token = engine.spec.kv_bytes_per_token(kv_dtype)
    block_size, layout, chunk = config.block_size, engine.runner.layout, engine.max_num_batched_tokens
    block_bytes = _block_bytes(engine, kv_dtype)
    budget = memory_budget(engine, gpu_memory_utilization, kv_cache_memory)
    cap = config.max_num_seqs * blocks_for_one_request_of(layout, max_model_len, block_size, chunk)
    if config.num_kv_blocks is not None and gpu_memory_utilization is None and kv_cache_memory is None:
        cap = budget  # num_kv_blocks fixes the pool's bytes, uncapped (a block is never under one byte)
    num_blocks = min(budget // block_bytes, cap)

    caching = engine.kv_cache_manager.caching
    # every layer group's blocks (a sliding group keeps only its window); the shared prefix stays in the
    # full-attention groups, a sliding group's copy leaves its window as the user's own tokens come
    per_user = blocks_for_one_request_of(layout, prompt_tokens + output_tokens, block_size, chunk)
    full_groups = sum(group.window is None for group in layout.groups)
    shared = shared_prefix_tokens // block_size * full_groups if caching else 0
    too_long = prompt_tokens + output_tokens > max_model_len
    unshared = 0 if too_long else min(num_blocks // per_user, config.max_num_seqs)
    by_pool = max(num_blocks - shared, 0) // (per_user - shared) if shared else num_blocks // per_user
    fit = 0 if too_long else min(by_pool, config.max_num_seqs)
    limit = "max_model_len" if too_long else "max_num_seqs" if by_pool > config.max_num_seqs else "KV pool"
    bytes_needed = (shared + users * (per_user - shared)) * block_bytes
    on_gpu = engine.device.type == "cuda" and engine.pool_plan.gpu_memory is not None
    return MemoryPlan(
        prompt_tokens, output_tokens, users, shared_prefix_tokens, block_size, num_blocks, num_blocks * block_bytes,
        bytes_per_token, str(kv_dtype).removeprefix("torch."), max_model_len, config.max_num_seqs, caching,
        per_user, shared, unshared, fit, limit, bytes_needed,
        _utilization_needed(engine, bytes_needed) if on_gpu else None, None if on_gpu else bytes_needed,
        {name: _users_in(budget, _block_bytes(engine, _KV_DTYPES[name]), per_user, shared, cap, config.max_num_seqs,
                         too_long)
         for name in ("float32", "bfloat16", "fp8")})


_KV_DTYPES = {**_DTYPES, "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn}  # + the fp8 cache


def _dtype(name) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _KV_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_KV_DTYPES)}, got {name!r}")
    return _KV_DTYPES[name]


def memory_budget(engine, gpu_memory_utilization: float | None, kv_cache_memory: int | None) -> int:
    """Bytes the pool may use: on a GPU what the start-up profile left for it (moved by the utilization
    asked for), on a CPU kv_cache_memory."""
    config = engine.config
    profile = engine.pool_plan.gpu_memory
    if config.num_kv_blocks is not None and gpu_memory_utilization is None and kv_cache_memory is None:
        return config.num_kv_blocks * engine.runner.block_bytes()
    if profile is not None:
        if gpu_memory_utilization is None:
            return profile.available
        util = as_float("gpu_memory_utilization", gpu_memory_utilization, "in (0, 1]", 0.0, 1.0, low_open=True)
        return max(int(profile.available + (util - config.gpu_memory_utilization) * profile.total), 0)
    if kv_cache_memory is not None:
        return as_int("kv_cache_memory", kv_cache_memory, "bytes, an int >= 1", 1)
    return config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY


def _block_bytes(engine, kv_dtype: torch.dtype) -> int:
    """One block id's bytes in kv_dtype: block_size tokens of every layer, or of one layer group's (hybrid)."""
    spec, layout = engine.spec, engine.runner.layout
    return spec.kv_bytes_per_token(kv_dtype) // spec.num_layers * layout.layers_per_block * engine.config.block_size


def _utilization_needed(engine, bytes_needed: int) -> float:
    profile = engine.pool_plan.gpu_memory
    return engine.config.gpu_memory_utilization + (bytes_needed - profile.available) / profile.total


def _users_in(budget: int, block_bytes: int, per_user: int, shared: int, cap: int, max_num_seqs: int,
              too_long: bool) -> int:
    if too_long:
        return 0
    blocks = min(budget // block_bytes, cap)
    return min(max(blocks - shared, 0) // (per_user - shared), max_num_seqs)
