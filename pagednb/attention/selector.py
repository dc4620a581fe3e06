"""Which attention backend the engine uses on a device.

"auto": on a CUDA device, pagednb's own kernels (compiled on first use, cached on disk); when they
cannot be built (no nvcc, a failed build) the pure-torch reference, with one warning saying why. On a
CPU, the reference. An fp8 KV cache under a float32 model gets the reference on a GPU too: the kernels read
fp8 for bf16/fp16 queries only. "torch_ref" forces the reference anywhere; "cuda" forces the kernels and
raises if they are unavailable (or cannot serve an fp8 cache under float32).
"""
from __future__ import annotations

import warnings

import torch

from pagednb.attention.backend import AttentionBackend
from pagednb.attention.torch_ref import TorchReferenceBackend

BACKENDS = ("auto", "torch_ref", "cuda")


def select_attention_backend(device: torch.device, name: str = "auto",
                             fp8_cache_in_float32: bool = False) -> AttentionBackend:
    """"auto": the fastest backend that works on `device`; a name forces that backend."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    device = torch.device(device)
    if device.type == "cuda" and fp8_cache_in_float32:
        if name == "cuda":
            raise ValueError("attention_backend='cuda' cannot serve kv_cache_dtype='fp8' under a float32 model: the "
                             "kernels read fp8 for bfloat16/float16 models (dtype='bfloat16'), or use 'auto'")
        if name == "auto":
            warnings.warn("pagednb: an fp8 KV cache under a float32 model runs on the pure-torch attention backend "
                          "(the kernels read fp8 for bfloat16/float16 models: dtype='bfloat16' puts it on them)",
                          RuntimeWarning, stacklevel=3)
        return TorchReferenceBackend()
    if name == "torch_ref" or (name == "auto" and device.type != "cuda"):
        return TorchReferenceBackend()
    if name == "cuda" and device.type != "cuda":
        raise RuntimeError(f"attention_backend='cuda' needs a CUDA device; the engine runs on {device}")
    from pagednb.kernels import load_error, load_kernels

    lib = load_kernels()  # None (after one warning saying why) when the kernels cannot be built here
    if lib is None:
        if name == "cuda":
            raise RuntimeError(f"attention_backend='cuda' was requested but pagednb's CUDA kernels are "
                               f"unavailable: {load_error()}")
        return TorchReferenceBackend()
    from pagednb.attention.cuda_backend import CudaPagedBackend

    return CudaPagedBackend(lib)
