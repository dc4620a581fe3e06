"""Fused elementwise ops of the decoder layers: one CUDA kernel each where torch runs a chain.

In a decode step the launches, not the arithmetic, take the time of these ops: torch runs about 9
small kernels for an RMSNorm with its residual add, about 20 for Qwen3's per-head q/k norm plus the
rotary embedding, and 2 for SiLU(gate) * up or GELU-tanh(gate) * up (Gemma's MLP). Each op here comes in two forms:

  * a reference (`*_reference`): the plain torch code with HF transformers' rounding points. It runs
    on CPU, where pagednb's CUDA library is unavailable (load_kernels() warns why), for inputs the
    kernels do not cover (dtype, shape, alignment, autograd), and everywhere under PAGEDNB_FUSED_OPS=0
    (read once per process);
  * a kernel (kernels_cuda/fused_ops.cu) that keeps those rounding points: every elementwise result is
    rounded to the model dtype where torch rounds it. Only the order in which a norm adds up its float32
    sum of squares differs, which can move a result by one unit in the last place.

The choice between them looks only at devices, dtypes, shapes, strides and pointer alignment; the
kernel path allocates with torch.empty and launches on the current stream, so it can be captured in a
CUDA graph.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from pagednb.attention.kv_quant import is_fp8
from pagednb.kernels import LazyKernel, check_status, current_stream, dtype_codes, head_dims
from pagednb.kernels.qk_rope_rows import qk_rope_rows_fit
from pagednb.model.rotary import apply_rotary


# a gated MLP's activation, by the kernels' code for it (kernels_cuda/launchers.h GemvGate), and by its name
SILU, GELU_TANH = 1, 2
GATES = {"silu": SILU, "gelu_tanh": GELU_TANH}


# ---- the ops ---------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             weight_offset: float | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [..., hidden]: out, or with a residual (out, x + residual). New tensors; the
    inputs are left as they are. weight_offset None: Llama's rounding; a number: the weight plus it
    applied in float32 (OLMo 2: 0, Gemma: 1; see rms_norm_reference)."""
    kernels = _kernels_for(x, weight, residual)
    if kernels is not None:
        result = kernels.rms_norm(x, weight, eps, residual, weight_offset)
        if result is not None:
            return result
    return rms_norm_reference(x, weight, eps, residual, weight_offset)


def fused_ops_enabled(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether ops on x (and others) run on pagednb's fused kernels (a GPU tensor, no autograd graph,
    PAGEDNB_FUSED_OPS not 0, the kernels built): an attention backend's fused prologue (attend_rope) follows the
    same switch as qk_norm_rope."""
    return _kernels_for(x, *others) is not None


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, *, weight_offset: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [N, H, D] and k [N, Hkv, D] (with the weights; Qwen3, and Gemma 3 with
    weight_offset 1, as rms_norm), then the rotary embedding with cos, sin [N, 1, D] (narrower than D:
    partial rotary, reference only). The kernel writes q and k in place (they may be strided views
    of the fused qkv output) and returns them; the reference returns new tensors. Callers use the
    returned pair and must not rely on q and k afterwards."""
    kernels = _kernels_for(q, k, q_weight, k_weight)
    if kernels is not None:
        result = kernels.qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, weight_offset)
        if result is not None:
            return result
    return qk_norm_rope_reference(q, k, cos, sin, q_weight, k_weight, eps, weight_offset)


def qk_norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                          kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, weight_offset: float | None = None,
                          kv_scales: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor] | None:
    """qk_norm_rope, plus the step's K (after the rotary embedding) and V written into the paged cache
    [2, num_blocks, block_size, Hkv, D] (attention/backend.py's layout) at slot_mapping (-1: skipped), in
    the same launch; an fp8 cache gets fp8(K / k_scale) and fp8(V / v_scale) (attention/kv_quant.py). None
    when the kernel cannot serve these inputs: the caller then runs qk_norm_rope and its backend's write_kv,
    which give the same q, k and cache."""
    kernels = _kernels_for(q, k, v, q_weight, k_weight)
    if kernels is None:
        return None
    return kernels.qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, weight_offset,
                                (v, kv_cache, slot_mapping, *kv_scales))


def gate_and_mul(gate_up: torch.Tensor, gate: int) -> torch.Tensor:
    """act(gate) * up for gate_up [..., 2 * I] = [gate | up]; a new [..., I] tensor. act by its code: SILU, or
    GELU_TANH (gelu(approximate="tanh"), Gemma 2/3)."""
    kernels = _kernels_for(gate_up)
    result = kernels.gate_and_mul(gate_up, gate) if kernels is not None else None
    if result is not None:
        return result
    return (silu_and_mul_reference if gate == SILU else gelu_tanh_and_mul_reference)(gate_up)


# ---- references: the torch code the kernels reproduce ---------------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None, weight_offset: float | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF's RMSNorm: x + residual added in the model dtype, normalised in float32, cast back to the
    model dtype, then scaled by the weight (Llama); with a weight_offset, scaled by weight + offset in
    float32 and cast back once (OLMo 2: 0; Gemma: 1, its checkpoints store w - 1)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype) if weight_offset is None else (h * (weight_offset + weight.float())).to(x.dtype)
    return out if residual is None else (out, x)


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                           eps: float = 1e-6, weight_offset: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if q_weight is not None:
        q = rms_norm_reference(q, q_weight, eps, weight_offset=weight_offset)
        k = rms_norm_reference(k, k_weight, eps, weight_offset=weight_offset)
    return apply_rotary(q, k, cos, sin)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """HF's gelu_pytorch_tanh (torch's gelu, approximate="tanh", in the model dtype: float32 inside, rounded
    once), then the product with up rounded again."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# ---- the kernels -------------------------------------------------------------------------------------
class FusedKernels:
    """ctypes calls into kernels_cuda/fused_ops.cu. Each method returns None for inputs the kernels do
    not cover (the op then runs its reference) and raises RuntimeError when a launch fails."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._dtype_codes = dtype_codes(lib)
        self._head_dims = head_dims(lib)
        self._max_norm_row_bytes = lib.pagednb_max_norm_row_bytes()  # the RMSNorm kernel keeps a row in registers

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, weight_offset: float | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        code = self._dtype_codes.get(x.dtype)
        hidden, es = x.shape[-1], x.element_size()
        x_stride = _row_stride(x)
        if (code is None or x_stride is None or x.numel() == 0 or hidden * es > self._max_norm_row_bytes
                or weight.dtype != x.dtype or weight.shape != (hidden,) or weight.stride(0) != 1
                or weight.device != x.device):
            return None
        r_stride, r_ptr = 0, None
        if residual is not None:
            r_stride = _row_stride(residual)
            if r_stride is None or residual.shape != x.shape or residual.dtype != x.dtype:
                return None
            r_ptr = residual.data_ptr()
        if (x.data_ptr() | weight.data_ptr() | (r_ptr or 0) | (x_stride | r_stride | hidden) * es) % 16:
            return None
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        new_residual = torch.empty_like(out) if residual is not None else None
        rc = self._lib.pagednb_rms_norm(
            code, out.data_ptr(), None if new_residual is None else new_residual.data_ptr(), x.data_ptr(),
            x_stride, r_ptr, r_stride, weight.data_ptr(), out.numel() // hidden, hidden, eps,
            *_norm_weight(weight_offset), current_stream(x))
        self._check(rc, "rms_norm")
        return out if new_residual is None else (out, new_residual)

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                     weight_offset: float | None = None,
                     cache_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cache_write: (v, kv_cache, slot_mapping, k_scale, v_scale) to write the step's K/V into the cache
        as well (the scales apply to an fp8 cache only)."""
        code = self._dtype_codes.get(q.dtype)
        if code is None or q.dim() != 3 or k.dim() != 3:
            return None
        n, heads, d = q.shape
        if d not in self._head_dims or n == 0 or not qk_rope_rows_fit(q, k, cos, sin, q_weight, k_weight):
            return None
        write = _cache_write_args(cache_write, q, k)
        if write is None:
            return None
        rc = self._lib.pagednb_qk_norm_rope(
            code, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            cos.data_ptr(), sin.data_ptr(), cos.stride(0),
            None if q_weight is None else q_weight.data_ptr(), None if k_weight is None else k_weight.data_ptr(),
            n, heads, k.shape[1], d, eps, *_norm_weight(weight_offset), *write, current_stream(q))
        self._check(rc, "qk_norm_rope")
        return q, k

    def gate_and_mul(self, gate_up: torch.Tensor, gate: int) -> torch.Tensor | None:
        """act(gate) * up, act by its code (SILU, GELU_TANH)."""
        code = self._dtype_codes.get(gate_up.dtype)
        stride = _row_stride(gate_up)
        inter = gate_up.shape[-1] // 2
        if code is None or stride is None or gate_up.shape[-1] % 2 or gate_up.numel() == 0:
            return None
        if (gate_up.data_ptr() | (stride | inter) * gate_up.element_size()) % 16:
            return None
        out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
        rc = self._lib.pagednb_gate_and_mul(code, gate, out.data_ptr(), gate_up.data_ptr(), stride,
                                            out.numel() // inter, inter, current_stream(gate_up))
        self._check(rc, "gate_and_mul")
        return out

    def _check(self, rc: int, what: str) -> None:
        check_status(self._lib, rc, what)


KERNELS = LazyKernel(FusedKernels)  # made on first use; KERNELS.enabled() is None under PAGEDNB_FUSED_OPS=0


def _kernels_for(x: torch.Tensor, *others: torch.Tensor | None) -> FusedKernels | None:
    """The kernels for an op on x, or None: x is not on a GPU, autograd needs the graph (the kernels
    have no backward), or the kernels are off or unavailable. Checked per call; cheap."""
    if not x.is_cuda:
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *others)):
        return None
    return KERNELS.enabled()


def _cache_write_args(cache_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None,
                      q: torch.Tensor, k: torch.Tensor) -> tuple | None:
    """(v, v strides, cache, V-half offset, slots, fp8 flag, k/v scales) for the kernel (null pointers: no
    cache write), or None if it cannot take them. An fp8 cache only under a 16-bit model (float32 models
    write through the reference)."""
    if cache_write is None:
        return None, 0, 0, None, 0, None, 0, 1.0, 1.0
    v, kv_cache, slots, k_scale, v_scale = cache_write
    n, hkv, d = k.shape
    fp8 = is_fp8(kv_cache.dtype) and q.dtype != torch.float32
    if (v.shape != k.shape or v.dtype != q.dtype or v.stride(2) != 1 or v.device != q.device
            or kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[-2:] != (hkv, d)
            or (kv_cache.dtype != q.dtype and not fp8) or not kv_cache.is_contiguous() or kv_cache.device != q.device
            or slots.dtype != torch.int64 or slots.dim() != 1 or slots.stride(0) != 1 or slots.shape[0] < n
            or slots.device != q.device):
        return None
    es = q.element_size()
    if (v.data_ptr() | kv_cache.data_ptr() | (v.stride(0) | v.stride(1)) * es) % 16:
        return None
    return (v.data_ptr(), v.stride(0), v.stride(1), kv_cache.data_ptr(), kv_cache[0].numel(), slots.data_ptr(),
            int(fp8), float(k_scale), float(v_scale))


def _norm_weight(weight_offset: float | None) -> tuple[float, int]:
    """The kernels' NormWeight (launchers.h): (offset, 1) applies weight + offset in float32; (0, 0) is Llama's."""
    return (0.0, 0) if weight_offset is None else (float(weight_offset), 1)


def _row_stride(t: torch.Tensor) -> int | None:
    """Elements between consecutive rows of t seen as [rows, last dim], or None if that needs a copy."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t.stride(0)
    return t.shape[-1] if t.is_contiguous() else None

