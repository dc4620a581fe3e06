"""What the q/k norm + rotary embedding kernels can read: one check for both of their callers, fused_ops.cu's
launch (model/fused_ops.py) and the decode kernels' fused prologue (attention/cuda_backend.py, attend_rope), which
share their per-row code (kernels_cuda/qk_rope.cuh)."""
from __future__ import annotations

import torch


def qk_rope_rows_fit(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, *others: torch.Tensor) -> bool:
    """Whether the kernels can read these rows as 16-byte vectors: q [N, H, D], k and others (v) [N, heads, D] of
    q's dtype with dense last dims; cos, sin one dense row of D per token ([N, 1, D] or [N, D]); both norm weights
    [D] or neither; every row start and stride 16-byte aligned."""
    n, _, d = q.shape
    rows = (q, k, *others)
    if any(t.dim() != 3 or t.shape[0] != n or t.shape[2] != d or t.stride(2) != 1 or t.dtype != q.dtype
           for t in rows):
        return False
    for t in (cos, sin):
        if (t.dtype != q.dtype or t.device != q.device or t.shape[0] != n or t.shape[-1] != d
                or t.numel() != n * d or t.stride(-1) != 1 or t.stride(0) != cos.stride(0)):
            return False
    weights = [w for w in (q_weight, k_weight) if w is not None]
    if len(weights) == 1 or any(w.dtype != q.dtype or w.shape != (d,) or w.stride(0) != 1 or w.device != q.device
                                for w in weights):
        return False
    ptrs = [t.data_ptr() for t in (*rows, cos, sin, *weights)]
    strides = [t.stride(i) * t.element_size() for t in rows for i in (0, 1)] + [cos.stride(0) * cos.element_size()]
    return all(x % 16 == 0 for x in (*ptrs, *strides))
