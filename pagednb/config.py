"""Engine configuration: what the user asked for, checked once and resolved into concrete values."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
           "float": torch.float32}
SCHEDULING_POLICIES = ("fcfs", "priority")
DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 2**30  # bytes; a CPU has no profiler rule, so a plain budget


@dataclass
class EngineConfig:
    """Every knob of the engine, and the one place their defaults live: `LLM(model, **options)` takes
    these fields as its keyword options. The `resolve_*` methods turn "auto" and None into real values."""

    model: str
    dtype: str | torch.dtype = "auto"
    device: str | torch.device = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    scheduling_policy: str = "fcfs"
    seed: int = 0
    kv_cache_memory: int | None = None  # the KV cache budget in bytes on a CPU (None: 2 GiB)
    gpu_memory_utilization: float = 0.9
    trust_remote_code: bool = False
    revision: str | None = None
    tokenizer: str | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False  # True: no CUDA graphs (every step launches its kernels one by one)
    max_cuda_graph_batch_size: int = 512  # decode graphs cover batches up to min(this, max_num_seqs)
    async_scheduling: bool | None = None  # None: on for a GPU (host work overlaps the device's), off on a CPU

    def validate(self) -> None:
        """Raises ValueError naming the field and its limit; called before anything heavy is loaded."""
        _check(self.block_size in (8, 16, 32, 64, 128), f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(self.max_model_len is None or self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}")
        _check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        _check(self.kv_cache_memory is None or self.kv_cache_memory > 0, f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        _check(self.max_cuda_graph_batch_size >= 1,
               f"max_cuda_graph_batch_size must be >= 1, got {self.max_cuda_graph_batch_size}")
        _check(0 < self.gpu_memory_utilization <= 1,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.scheduling_policy in SCHEDULING_POLICIES,
               f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")

    def resolve_device(self) -> torch.device:
        if str(self.device) == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        _check(device.type != "cuda" or torch.cuda.is_available(), "device='cuda' asked for, but CUDA is not available")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        """"auto": bfloat16 on a GPU (halves memory traffic), float32 on a CPU (fast and exact there)."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        _check(self.dtype in _DTYPES, f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        return _DTYPES[self.dtype]

    def resolve_max_model_len(self, max_position_embeddings: int) -> int:
        if self.max_model_len is None:
            return max_position_embeddings
        _check(self.max_model_len <= max_position_embeddings,
               f"max_model_len must be <= the model's max_position_embeddings ({max_position_embeddings}), "
               f"got {self.max_model_len}")
        return self.max_model_len

    def resolve_max_num_batched_tokens(self, device: torch.device) -> int:
        """Chunked prefill is always on, so the budget need not cover a whole max_model_len prompt."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if device.type == "cuda" else 2048


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
