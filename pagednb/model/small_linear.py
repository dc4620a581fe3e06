"""Linear layers for the one or two rows of a small decode step: a weight-streaming GEMV kernel.

At batch 1 a decode step is a pass over the weights: every projection multiplies one row by a
matrix read from memory once. cuBLAS reads a small model's projections at 0.3-2 TB/s at M = 1 on an
H200 (its tiles are built for many rows), which made the GEMMs 0.85 ms of a 1.4 ms Qwen3-0.6B step.
kernels_cuda/gemv.cu streams each weight row with 16-byte loads and serves every row from each load.

`linear(x, weight, bias)` is F.linear's contract. The kernel runs where benchmarks/linear.py measured
it faster than cuBLAS on both benchmark shapes: one row, and two rows for matrices of fewer than 4,096
output features (o_proj, down_proj; wider ones at two rows, and everything at three or more, stay on
cuBLAS); for bf16/fp16 CUDA inputs with aligned rows and a dense weight, without autograd, unless
PAGEDNB_FUSED_OPS=0. Everything else is F.linear. The kernel's sums are float32 in an order that
depends only on the weight's shape, so a row gives the same bits alone, beside another row, or in a
CUDA-graph bucket; against cuBLAS the result may differ by a rounding of the output.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from pagednb.kernels import LazyKernel, check_status, current_stream, dtype_codes

GEMV_TWO_ROWS_MAX_FEATURES = 4096  # two rows: only narrower weights (benchmarks/linear.py)
_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias[N]) -> [..., N], on the GEMV kernel where it applies."""
    if _gemv_applies(x, weight, bias):
        out = KERNEL.enabled().gemv(x, weight, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward is `linear` (same parameters, same checkpoint names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def gemv_serves(rows: int, out_features: int) -> bool:
    """Whether the kernel beats cuBLAS for this many rows of this weight (benchmarks/linear.py)."""
    return rows == 1 or (rows == 2 and out_features < GEMV_TWO_ROWS_MAX_FEATURES)


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The cheap checks first (this runs for every projection of every step)."""
    if not x.is_cuda or x.dtype not in _GEMV_DTYPES or weight.dtype != x.dtype:
        return False
    if x.dim() < 1 or x.numel() == 0 or not gemv_serves(x.numel() // x.shape[-1], weight.shape[0]):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return False
    return KERNEL.enabled() is not None


class GemvKernel:
    """ctypes call into kernels_cuda/gemv.cu; returns None for inputs it does not cover."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._dtype_codes = dtype_codes(lib)
        self.max_rows = lib.pagednb_gemv_max_rows()  # the most rows one launch takes (gemv_serves: 1 or 2)

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        k = x.shape[-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        n = weight.shape[0]
        if (weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous() or x2.stride(-1) != 1
                or weight.device != x.device or k % 8):
            return None
        if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.stride(0) != 1
                                 or bias.device != x.device):
            return None
        x_stride = x2.stride(0) if x2.shape[0] > 1 else k
        if (x2.data_ptr() | weight.data_ptr() | x_stride * x.element_size()) % 16:
            return None
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        rc = self._lib.pagednb_gemv(self._dtype_codes[x.dtype], out.data_ptr(), n, x2.data_ptr(), x_stride,
                                    weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                    x2.shape[0], n, k, current_stream(x))
        check_status(self._lib, rc, "gemv")
        return out


KERNEL = LazyKernel(GemvKernel)  # made on first use; KERNEL.enabled() is None under PAGEDNB_FUSED_OPS=0
