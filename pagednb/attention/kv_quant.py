"""The FP8 KV cache's number format, as vLLM stores it: float8 e4m3 with one scale per layer for K and one for V.

A K (or V) element x is stored as fp8(x / scale), saturated to e4m3's finite range (+-448) and rounded to
nearest even, and read back as fp8 * scale. With 3 mantissa bits the relative rounding error is at most
2^-4 (6.25%) of a value in e4m3's normal range; values under 2^-6 * scale lose precision further
(subnormals). The default scale is 1.0 (vLLM's when a checkpoint carries none): the K/V of the models
pagednb serves sit far inside +-448. This file is the reference that the CUDA kernels (kernels_cuda/
common.cuh) reproduce bit for bit on write: the same division in float32, the same saturation and rounding.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> fp8(x / scale), saturated: torch's own cast turns out-of-range values into NaN."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """fp8 -> float32 values, x * scale."""
    return x.float() * scale
