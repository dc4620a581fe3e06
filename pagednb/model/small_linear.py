"""Linear layers for the one or two rows of a small decode step: a weight-streaming GEMV kernel.

At batch 1 a decode step is a pass over the weights: every projection multiplies one row by a
matrix read from memory once. cuBLAS reads a small model's projections at 0.3-2 TB/s at M = 1 on an
H200 (its tiles are built for many rows), which made the GEMMs 0.85 ms of a 1.4 ms Qwen3-0.6B step.
kernels_cuda/gemv.cu streams each weight row with 16-byte loads and serves every row from each load.

`linear(x, weight, bias)` is F.linear's contract. The GEMV also takes over two fused_ops kernels around
it, each saving a launch per layer (and the write and read back of what it would have made), with the
same bits:
  * a `NormedInput` handed to a `Linear` (a block's first projection: qkv, gate/up): RMSNorm(hidden +
    residual) computed by every CTA from the 1-2 rows, the sum hidden + residual (the residual stream)
    written once; anywhere the GEMV does not serve, the norm runs first (`NormedInput.materialise`);
  * `linear_gate_and_mul(x, gate_up_weight, bias, gate)`: a gated MLP's gate/up projection followed by
    SiLU(gate) * up or Gemma's GELU-tanh(gate) * up, applied by the GEMV to its own outputs (a warp computes a
    gate row and its up row together).
The kernel runs where benchmarks/linear.py measured it faster than cuBLAS on both benchmark shapes: one
row, and two rows for matrices of fewer than 4,096 output features (o_proj, down_proj; wider ones at two
rows, and everything at three or more, stay on cuBLAS); for bf16/fp16 CUDA inputs with aligned rows and
a dense weight, without autograd, unless PAGEDNB_FUSED_OPS=0. Everything else is F.linear. The kernel's
sums are float32 in an order that depends only on the weight's shape, so a row gives the same bits alone,
beside another row, or in a CUDA-graph bucket; against cuBLAS the result may differ by a rounding of the
output.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagednb.kernels import LazyKernel, check_status, current_stream, dtype_codes
from pagednb.model.fused_ops import gate_and_mul, rms_norm

GEMV_TWO_ROWS_MAX_FEATURES = 4096  # two rows: only narrower weights (benchmarks/linear.py)
_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias[N]) -> [..., N], on the GEMV kernel where it applies."""
    if _gemv_applies(x, weight, bias):
        out = KERNEL.enabled().gemv(x, weight, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


@dataclass
class NormedInput:
    """RMSNorm(hidden + residual) (hidden alone without a residual), not computed yet: a decoder block's input,
    consumed by the block's first projection. `stream` is hidden + residual once it has been (the residual
    stream of the next block); the norm is fused_ops.rms_norm's, with its weight, eps and weight_offset."""

    hidden: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    weight_offset: float | None
    stream: torch.Tensor | None = None

    def materialise(self) -> torch.Tensor:
        """The normed rows, by the RMSNorm kernel (or its reference); sets `stream`."""
        if self.residual is None:
            self.stream = self.hidden
            return rms_norm(self.hidden, self.weight, self.eps, None, self.weight_offset)
        out, self.stream = rms_norm(self.hidden, self.weight, self.eps, self.residual, self.weight_offset)
        return out


def normed_linear(x: NormedInput, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(x.materialise(), weight, bias), the norm inside the GEMV where it serves the rows."""
    if _normed_gemv_applies(x, weight, bias):
        out = KERNEL.enabled().gemv_rms_norm(x, weight, bias)
        if out is not None:
            return out
    return linear(x.materialise(), weight, bias)


def linear_gate_and_mul(x: torch.Tensor | NormedInput, weight: torch.Tensor, bias: torch.Tensor | None,
                        gate: int) -> torch.Tensor:
    """gate_and_mul(linear(x, weight, bias), gate) for weight [2 * I, K] = [gate | up] rows and an activation
    code (fused_ops.SILU, GELU_TANH); a NormedInput x is normed first: [..., I], in one GEMV launch where it
    serves the rows."""
    normed = isinstance(x, NormedInput)
    if _normed_gemv_applies(x, weight, bias) if normed else _gemv_applies(x, weight, bias):
        kernel = KERNEL.enabled()
        out = kernel.gemv_rms_norm(x, weight, bias, gate) if normed else kernel.gemv(x, weight, bias, gate)
        if out is not None:
            return out
    return gate_and_mul(normed_linear(x, weight, bias) if normed else linear(x, weight, bias), gate)


class Linear(nn.Linear):
    """nn.Linear whose forward is `linear` (same parameters, same checkpoint names); it also takes a
    NormedInput (normed_linear)."""

    def forward(self, x: torch.Tensor | NormedInput) -> torch.Tensor:
        if isinstance(x, NormedInput):
            return normed_linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)


def gemv_serves(rows: int, out_features: int) -> bool:
    """Whether the kernel beats cuBLAS for this many rows of this weight (benchmarks/linear.py)."""
    return rows == 1 or (rows == 2 and out_features < GEMV_TWO_ROWS_MAX_FEATURES)


def _normed_gemv_applies(x: NormedInput, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    autograd = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x.weight, x.residual))
    return not autograd and _gemv_applies(x.hidden, weight, bias)


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
        self.max_norm_width = lib.pagednb_gemv_max_norm_width()  # a NormedInput's rows sit in shared memory

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             gate: int = 0) -> torch.Tensor | None:
        """x @ weight.T (+ bias); with a gate (fused_ops.SILU, GELU_TANH), act(gate) * up of that product's [gate | up]
        halves."""
        k = x.shape[-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        n = weight.shape[0]
        if (weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous() or x2.stride(-1) != 1
                or weight.device != x.device or k % 8 or (gate and n % 2)):
            return None
        if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.stride(0) != 1
                                 or bias.device != x.device):
            return None
        x_stride = x2.stride(0) if x2.shape[0] > 1 else k
        if (x2.data_ptr() | weight.data_ptr() | x_stride * x.element_size()) % 16:
            return None
        width = n // 2 if gate else n
        out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
        rc = self._lib.pagednb_gemv(self._dtype_codes[x.dtype], out.data_ptr(), width, x2.data_ptr(), x_stride,
                                    weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                    x2.shape[0], n, k, gate, current_stream(x))
        check_status(self._lib, rc, "gemv")
        return out

    def gemv_rms_norm(self, x: NormedInput, weight: torch.Tensor, bias: torch.Tensor | None,
                      gate: int = 0) -> torch.Tensor | None:
        """x.materialise() @ weight.T (+ bias) (gate as gemv) in one launch, setting x.stream; None
        (x untouched) for inputs it does not serve."""
        h, res, norm_w = x.hidden, x.residual, x.weight
        k = h.shape[-1]
        h2 = h if h.dim() == 2 else h.reshape(-1, k)
        n = weight.shape[0]
        if (weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous() or h2.stride(-1) != 1
                or weight.device != h.device or k % 8 or k > self.max_norm_width or norm_w.shape != (k,)
                or norm_w.dtype != h.dtype or norm_w.stride(0) != 1 or norm_w.device != h.device
                or (gate and n % 2)):
            return None
        if bias is not None and (bias.shape != (n,) or bias.dtype != h.dtype or bias.stride(0) != 1
                                 or bias.device != h.device):
            return None
        h_stride = h2.stride(0) if h2.shape[0] > 1 else k
        res_ptr, r_stride = None, 0
        if res is not None:
            r2 = res if res.dim() == 2 else res.reshape(-1, k)
            if res.shape != h.shape or res.dtype != h.dtype or r2.stride(-1) != 1:
                return None
            res_ptr, r_stride = r2.data_ptr(), (r2.stride(0) if r2.shape[0] > 1 else k)
        es = h.element_size()
        if (h2.data_ptr() | weight.data_ptr() | norm_w.data_ptr() | (res_ptr or 0) | (h_stride | r_stride) * es) % 16:
            return None
        width = n // 2 if gate else n
        out = torch.empty((*h.shape[:-1], width), dtype=h.dtype, device=h.device)
        stream = torch.empty(h.shape, dtype=h.dtype, device=h.device) if res is not None else h
        offset, in_float32 = (0.0, 0) if x.weight_offset is None else (float(x.weight_offset), 1)
        rc = self._lib.pagednb_gemv_rms_norm(
            self._dtype_codes[h.dtype], out.data_ptr(), width, h2.data_ptr(), h_stride, res_ptr, r_stride,
            None if res is None else stream.data_ptr(), norm_w.data_ptr(), x.eps, offset, in_float32,
            weight.data_ptr(), None if bias is None else bias.data_ptr(), h2.shape[0], n, k, gate,
            current_stream(h))
        check_status(self._lib, rc, "gemv_rms_norm")
        x.stream = stream
        return out


KERNEL = LazyKernel(GemvKernel)  # made on first use; KERNEL.enabled() is None under PAGEDNB_FUSED_OPS=0
