"""The mixture-of-experts MLP as one op: route each token to its top-k experts, run those experts' gated
MLPs, and add their outputs up weighted by the routing.

Routing: `select_experts` (the kernel on a GPU) and `select_experts_reference` (torch, HF's router code).
Experts are stored stacked, as HF 5.x stores them: w13 [E, 2 * I, H] (each expert's gate rows, then its up
rows) and w2 [E, H, I]. Two forms, as in fused_ops.py:

  * `fused_moe_reference`: HF's expert loop in plain torch (each hit expert on its tokens, the weighted
    outputs added in the model dtype). It runs on CPU, for float32, for inputs the kernel does not cover,
    under PAGEDNB_FUSED_OPS=0, and it is the tests' oracle;
  * the kernels (kernels_cuda/moe.cu) for bf16/fp16 on CUDA: the routing (softmax, top-k, renormalised,
    rounded) in one launch; then tokens sorted by expert on the device, a grouped tensor-core GEMM with
    SiLU(gate) * up fused in, the down GEMM, and the weighted top-k sum, in four launches with no host
    synchronisation (a CUDA graph can capture them); two launches up to 16 tokens (decode).

Prefill-sized calls in bf16 on Hopper or Blackwell (64 rows per expert and more) run the two expert GEMMs on
torch._grouped_mm (CUTLASS's grouped GEMM) instead, with the sort, gather and weighted sum around them in a few
memory-bound torch launches (`grouped_mm_moe`). On Qwen3-30B-A3B's layer (H200, benchmarks/moe.py) that path
took 0.65 / 0.94 / 2.06 ms at 1,024 / 2,048 / 8,192 tokens where the kernel took 0.73 / 1.01 / 3.28; at 512
tokens (32 rows per expert) the kernel wins, 0.50 vs 0.52 ms.

Where the kernel could serve the dtype but is not available, or the dtype is float32 on a GPU, the
fallback warns once, saying why.
"""
from __future__ import annotations

import ctypes
import functools
import warnings

import torch
import torch.nn.functional as F

from pagednb.kernels import LazyKernel, check_status, current_stream, dtype_codes, load_error
from pagednb.model.fused_ops import SILU, gate_and_mul


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   weights_in_logits_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids int64) [T, top_k] from router logits [T, E], as HF routes: softmax in float32,
    the top k, divided by their sum when `renormalize` (Mixtral always; Qwen3-MoE when norm_topk_prob), and
    rounded to the logits' dtype when `weights_in_logits_dtype` (Qwen3-MoE; Mixtral keeps float32).
    bf16/fp16 logits on a GPU take one kernel launch (torch takes five); ties go to the lower expert id."""
    if router_logits.is_cuda:
        kernel = KERNEL.enabled()
        routed = None if kernel is None else kernel.select_experts(router_logits, top_k, renormalize,
                                                                     weights_in_logits_dtype)
        if routed is not None:
            return routed
    return select_experts_reference(router_logits, top_k, renormalize, weights_in_logits_dtype)


def select_experts_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                             weights_in_logits_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts in torch, as HF's routers write it (Qwen3MoeTopKRouter, MixtralTopKRouter)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_in_logits_dtype:
        weights = weights.to(router_logits.dtype)
    return weights, ids


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k], for hidden
    [T, H]; a new [T, H] tensor in hidden's dtype."""
    if hidden.is_cuda:
        kernel = KERNEL.enabled()
        if kernel is not None:
            if grouped_mm_serves(hidden, w13, w2, topk_ids):
                return grouped_mm_moe(hidden, w13, w2, topk_weights, topk_ids)
            result = kernel.fused_moe(hidden, w13, w2, topk_weights, topk_ids)
            if result is not None:
                return result
        _warn_fallback(_fallback_reason(hidden, kernel))
    return fused_moe_reference(hidden, w13, w2, topk_weights, topk_ids)


def fused_moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """HF's loop (Qwen3MoeExperts / MixtralExperts): each expert that has tokens runs its gated MLP on
    them; the outputs, times their routing weights, are added up in the model dtype."""
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        return _dense_moe_reference(hidden, w13, w2, topk_weights, topk_ids)
    out = torch.zeros_like(hidden)
    for expert in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == expert)
        y = _expert_mlp(hidden[token], w13[expert], w2[expert])
        out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(hidden.dtype))
    return out


def _dense_moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> torch.Tensor:
    """The same sum without reading the routing on the host (which a CUDA graph capture forbids): every
    expert runs on every token, weighted 0 where it was not chosen. E times the work; only float32 CUDA
    graphs (no kernel for float32) take it."""
    out = torch.zeros_like(hidden)
    for expert in range(w13.shape[0]):
        weight = (topk_weights * (topk_ids == expert)).sum(dim=-1, keepdim=True)
        out += (_expert_mlp(hidden, w13[expert], w2[expert]) * weight).to(hidden.dtype)
    return out


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


# ---- prefill-sized calls: torch._grouped_mm ---------------------------------------------------------------
GROUPED_MM_MIN_ROWS_PER_EXPERT = 64  # measured crossover: between 32 (kernel faster) and 64 rows (module docstring)


def grouped_mm_serves(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """bf16 (CUTLASS's grouped GEMM in torch covers it on sm_90 / sm_100), dense stacked experts, rows of
    whole 16-byte vectors, and enough rows per expert that the GEMMs, not the weight bytes, take the time
    (checked first: a decode step's call is answered at once)."""
    if w13.dim() != 3 or topk_ids.numel() < GROUPED_MM_MIN_ROWS_PER_EXPERT * w13.shape[0]:
        return False
    if (hidden.dtype != torch.bfloat16 or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype
            or hidden.dim() != 2 or topk_ids.dim() != 2 or not _grouped_mm_on(hidden.device)):
        return False
    experts, two_inter, hidden_size = w13.shape
    return (hidden.shape[1] == hidden_size and w2.shape == (experts, hidden_size, two_inter // 2)
            and hidden_size % 8 == 0 and two_inter % 16 == 0 and w13.is_contiguous() and w2.is_contiguous())


@functools.cache
def _grouped_mm_on(device: torch.device) -> bool:
    return (device.type == "cuda" and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device)[0] in (9, 10))


def grouped_mm_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe with the expert GEMMs on torch._grouped_mm: the (token, slot) pairs sorted by expert, their
    hidden rows gathered, gate/up, act(gate) * up, down, the outputs put back in pair order and added up
    with their weights (one bmm: float32 sums rounded once, as the kernel; the weights in the model dtype).
    No host synchronisation. Any device where torch has the op (the tests run it on the CPU too)."""
    tokens, top_k = topk_ids.shape
    experts = w13.shape[0]
    sorted_ids, order = topk_ids.flatten().sort(stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(1, experts + 1, device=sorted_ids.device), out_int32=True)
    rows = hidden.index_select(0, order // top_k)
    act = gate_and_mul(torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends), SILU)
    expert_out = torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)
    by_pair = torch.empty_like(expert_out).index_copy_(0, order, expert_out)
    weights = topk_weights.to(hidden.dtype).view(tokens, 1, top_k)
    return torch.bmm(weights, by_pair.view(tokens, top_k, -1)).view(tokens, -1)


# ---- fallback warnings -------------------------------------------------------------------------------------
def _fallback_reason(hidden: torch.Tensor, kernel: MoeKernel | None) -> str:
    if kernel is None:
        return f"pagednb's CUDA kernels are unavailable ({load_error() or 'PAGEDNB_FUSED_OPS=0'})"
    if hidden.dtype not in (torch.float16, torch.bfloat16):
        return f"the fused MoE kernel covers bfloat16 and float16, not {hidden.dtype}"
    return "the fused MoE kernel does not cover these shapes or strides (see MoeKernel.fused_moe)"


@functools.cache
def _warn_fallback(reason: str) -> None:
    """Once per reason and process: a fallback is slow (an expert loop with a host sync per step)."""
    warnings.warn(f"pagednb: MoE layers run the torch reference: {reason}", RuntimeWarning, stacklevel=3)


# ---- the kernel --------------------------------------------------------------------------------------------
class MoeKernel:
    """ctypes call into kernels_cuda/moe.cu; returns None for inputs it does not cover."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._dtype_codes = dtype_codes(lib)
        self.max_experts: int = lib.pagednb_moe_max_experts()
        self.max_top_k: int = lib.pagednb_moe_max_topk()

    def select_experts(self, router_logits: torch.Tensor, top_k: int, renormalize: bool,
                       weights_in_logits_dtype: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """select_experts for 16-bit logits [T, E] with dense rows, E and top_k in the kernel's range."""
        if (router_logits.dtype not in (torch.float16, torch.bfloat16) or router_logits.dim() != 2
                or router_logits.stride(1) != 1):
            return None
        tokens, experts = router_logits.shape
        if not (1 <= top_k <= min(experts, self.max_top_k) and experts <= self.max_experts):
            return None
        device = router_logits.device
        weights_dtype = router_logits.dtype if weights_in_logits_dtype else torch.float32
        weights = torch.empty((tokens, top_k), dtype=weights_dtype, device=device)
        ids = torch.empty((tokens, top_k), dtype=torch.int64, device=device)
        rc = self._lib.pagednb_moe_select_experts(
            self._dtype_codes[router_logits.dtype], router_logits.data_ptr(), router_logits.stride(0),
            weights.data_ptr(), ids.data_ptr(), tokens, experts, top_k, int(renormalize),
            int(weights_in_logits_dtype), current_stream(router_logits))
        check_status(self._lib, rc, "moe_select_experts")
        return weights, ids

    def fused_moe(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor | None:
        if not self._covers(hidden, w13, w2, topk_weights, topk_ids):
            return None
        (tokens, hidden_size), (experts, two_inter, _), top_k = hidden.shape, w13.shape, topk_ids.shape[1]
        inter = two_inter // 2
        workspace_bytes = self._lib.pagednb_moe_workspace_bytes(tokens, hidden_size, inter, experts, top_k)
        if workspace_bytes < 0:
            return None
        device = hidden.device
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        out = torch.empty((tokens, hidden_size), dtype=hidden.dtype, device=device)
        ids = topk_ids.to(torch.int64).contiguous()  # torch.topk's dtype: no copy
        weights = topk_weights.contiguous()
        if weights.dtype not in (torch.float32, hidden.dtype):
            weights = weights.float()
        rc = self._lib.pagednb_fused_moe(
            self._dtype_codes[hidden.dtype], out.data_ptr(), hidden.data_ptr(), hidden.stride(0), w13.data_ptr(),
            w2.data_ptr(), ids.data_ptr(), weights.data_ptr(), self._dtype_codes[weights.dtype],
            workspace.data_ptr(), tokens, hidden_size, inter, experts, top_k, current_stream(hidden))
        check_status(self._lib, rc, "fused_moe")
        return out

    def _covers(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> bool:
        """bf16/fp16 on one device, dense stacked experts, rows of whole 16-byte vectors."""
        if (hidden.dtype not in (torch.float16, torch.bfloat16) or hidden.dim() != 2 or w13.dim() != 3
                or topk_ids.dim() != 2):
            return False
        tokens, hidden_size = hidden.shape
        experts, two_inter, _ = w13.shape
        if (w13.dtype != hidden.dtype or w2.dtype != hidden.dtype or w13.device != hidden.device
                or w2.device != hidden.device or topk_ids.device != hidden.device
                or topk_weights.device != hidden.device or topk_weights.shape != topk_ids.shape):
            return False
        if (w13.shape != (experts, two_inter, hidden_size) or w2.shape != (experts, hidden_size, two_inter // 2)
                or topk_ids.shape[0] != tokens or experts > self.max_experts):
            return False
        if not (w13.is_contiguous() and w2.is_contiguous()) or hidden.stride(1) != 1:
            return False
        return (hidden.data_ptr() | w13.data_ptr() | w2.data_ptr() | hidden.stride(0) * 2) % 16 == 0


KERNEL = LazyKernel(MoeKernel)  # made on first use; KERNEL.enabled() is None under PAGEDNB_FUSED_OPS=0
