"""Engine configuration: what the user asked for, checked once and resolved into concrete values."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagednb.attention.selector import BACKENDS as ATTENTION_BACKENDS
from pagednb.engine.spec_decode.config import SpeculativeConfig
from pagednb.validation import as_bool, as_choice, as_float, as_int, as_optional_str

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
           "float": torch.float32}
SCHEDULING_POLICIES = ("fcfs", "priority")
# the KV cache's element type (vLLM's names): "auto" is the model's dtype; "fp8" and "fp8_e4m3" store
# float8 e4m3 with a scale per layer (attention/kv_quant.py), half the bytes of bf16. vLLM's "fp8_e5m2" is
# refused: the kernels read e4m3 only.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
# "auto" and "safetensors" (vLLM's name) read the checkpoint; "dummy": random weights from config.json alone
LOAD_FORMATS = ("auto", "safetensors", "dummy")
BLOCK_SIZES = (8, 16, 32, 64, 128)
# Upper bounds of the sizing options: beyond these a value only allocates absurd memory or takes minutes
# (block tables, step buffers and logits grow with them before any request arrives).
LIMITS = {
    "max_num_seqs": 2**16,
    "max_num_batched_tokens": 2**20,
    "max_model_len": 2**24,
    "num_kv_blocks": 2**31 - 1,
    "max_cuda_graph_batch_size": 2048,
    "tensor_parallel_size": 64,
    "kv_cache_memory": 2**44,
}
LIMIT_REASONS = {
    "num_kv_blocks": "block ids are int32",
    "max_cuda_graph_batch_size": "one graph per 16 sequences; capturing more takes minutes",
    "tensor_parallel_size": "the GPUs of one host",
    "kv_cache_memory": "bytes, 16 TiB",
}
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
    load_format: str = "auto"  # "auto"/"safetensors": the checkpoint; "dummy": random weights, no checkpoint read
    tensor_parallel_size: int = 1  # GPUs (CPU: processes) the model is split over (pagednb/distributed/)
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" / "fp8_e4m3": float8 e4m3, scaled per layer
    # vLLM's {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}:
    # n-gram draft tokens verified in one forward (engine/spec_decode/); None: off
    speculative_config: dict | None = None

    def validate(self) -> None:
        """Checks every field's type and range (TypeError / ValueError naming the field and what it
        accepts) and normalises integral floats to ints; called before anything heavy is loaded. The upper
        bounds stop values that would allocate absurd memory or take minutes (LIMITS); the model-dependent
        memory estimate comes later, before the weights are loaded (model/spec.py check_start_up_memory)."""
        self.model = _path_like("model", self.model, optional=False)
        self.tokenizer = _path_like("tokenizer", self.tokenizer, optional=True)
        self.revision = as_optional_str("revision", self.revision)
        _check_dtype(self.dtype)
        _check_device(self.device)
        sizes = f"one of {', '.join(map(str, BLOCK_SIZES))}"
        self.block_size = as_int("block_size", self.block_size, sizes)
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be {sizes}, got {self.block_size}")
        for name in ("max_num_seqs", "max_cuda_graph_batch_size", "tensor_parallel_size"):
            setattr(self, name, _bounded_int(name, getattr(self, name)))
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory"):
            if getattr(self, name) is not None:
                setattr(self, name, _bounded_int(name, getattr(self, name), optional=True))
        self.seed = as_int("seed", self.seed, f"an int in [0, {2**64 - 1}]", 0, 2**64 - 1)
        self.gpu_memory_utilization = as_float("gpu_memory_utilization", self.gpu_memory_utilization,
                                               "in (0, 1]", 0.0, 1.0, low_open=True)
        as_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        as_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        as_choice("load_format", self.load_format, LOAD_FORMATS)
        as_choice("kv_cache_dtype", self.kv_cache_dtype, tuple(KV_CACHE_DTYPES))
        for name in ("enable_prefix_caching", "trust_remote_code", "enforce_eager"):
            as_bool(name, getattr(self, name))
        if self.async_scheduling is not None:
            as_bool("async_scheduling", self.async_scheduling)
        self.resolve_speculative_config()

    def resolve_speculative_config(self) -> SpeculativeConfig | None:
        """The checked speculative_config (ValueError/TypeError naming the key and what it accepts)."""
        return None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)

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

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pool's element type: the model's for "auto", else float8 e4m3 (1 byte per element)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype

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


def _bounded_int(name: str, value: object, optional: bool = False) -> int:
    low, high = 1, LIMITS[name]
    accepted = f"{'None or ' if optional else ''}an int in [{low}, {high:,}]"
    if name in LIMIT_REASONS:
        accepted += f" ({LIMIT_REASONS[name]})"
    return as_int(name, value, accepted, low, high)


def _path_like(name: str, value: object, optional: bool) -> str | None:
    if value is None and optional:
        return None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if not isinstance(value, str) or not value:
        accepted = "a model folder or Hugging Face Hub id (a non-empty str)"
        raise (ValueError if isinstance(value, str) else TypeError)(
            f"{name} must be {accepted}{' or None' if optional else ''}, got {value!r}")
    return value


def _check_dtype(dtype: object) -> None:
    if isinstance(dtype, torch.dtype):
        if dtype not in set(_DTYPES.values()):
            raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
        return
    as_choice("dtype", dtype, ("auto",) + tuple(sorted(_DTYPES)))


def _check_device(device: object) -> None:
    if str(device) == "auto":
        return
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N' (a str or torch.device), got {device!r}")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
