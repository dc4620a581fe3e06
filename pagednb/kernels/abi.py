"""The C ABI of pagednb's kernel library (kernels_cuda/bindings.cpp) as Python sees it.

Every ctypes signature lives here and is applied once, by `declare`, as jit.py loads the library, so a
wrapper calls `lib.pagednb_<op>(...)` without declaring anything. The tables of what the kernels take
(dtype codes, head dims, size limits) are not copied here: `dtype_codes`, `head_dims` and the scalar
getters read them from the library, whose C++ constants are the only source. Without the library
(a CPU, a failed build) there are no tables: nothing outside the kernel wrappers needs them, and the
wrappers only exist over a loaded library.
`AttnParams` mirrors a C struct; `pagednb_params_size` lets the attention backend check its layout.
"""
from __future__ import annotations

import ctypes

import torch

_VP, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_IP = ctypes.POINTER(ctypes.c_int)

# name: (argument types, result type); the order follows bindings.cpp
SIGNATURES: dict[str, tuple[list, type | None]] = {
    # attention (cuda_backend.py)
    "pagednb_row_plan": ([_I32, _I32, _I32, _I32, _I32, _I32, _I32, _I32, _I32, _IP, _IP, _IP], _I32),
    "pagednb_decode_tensor_cores": ([_I32, _I32, _I32, _I32, _I32], _I32),
    "pagednb_decode_fuses_rope": ([_I32, _I32, _I32, _I32, _I32, _I32], _I32),
    "pagednb_decode_resident_ctas": ([_I32, _I32, _I32, _I32, _I32], _I32),
    "pagednb_row_attention": ([_I32, _I32, _VP, _VP], _I32),
    "pagednb_prefill_attention": ([_I32, _I32, _VP, _VP], _I32),
    "pagednb_prefill_occupancy": ([_I32, _I32], _I32),
    "pagednb_write_kv": ([_VP, _VP, _I64, _I64, _VP, _I64, _VP, _I32, _I64, _I32, _F32, _F32, _VP], _I32),
    # fused elementwise ops (model/fused_ops.py)
    "pagednb_rms_norm": ([_I32, _VP, _VP, _VP, _I64, _VP, _I64, _VP, _I32, _I32, _F32, _F32, _I32, _VP], _I32),
    "pagednb_qk_norm_rope": ([_I32, _VP, _I64, _I64, _VP, _I64, _I64, _VP, _VP, _I64, _VP, _VP,
                              _I32, _I32, _I32, _I32, _F32, _F32, _I32, _VP, _I64, _I64, _VP, _I64, _VP,
                              _I32, _F32, _F32, _VP], _I32),
    "pagednb_gate_and_mul": ([_I32, _I32, _VP, _VP, _I64, _I32, _I32, _VP], _I32),
    # temperature sampling (engine/sampling_kernel.py)
    "pagednb_sample_temperature": ([_I32, _VP, _I64, _VP, _I64, _VP, _I64, _VP, _I32, _I32, _VP], _I32),
    "pagednb_sample_greedy": ([_I32, _VP, _I64, _VP, _I32, _I32, _VP], _I32),
    "pagednb_mask_logits": ([_I32, _VP, _I64, _VP, _I64, _I32, _I32, _VP], _I32),
    # small-batch linear (model/small_linear.py)
    "pagednb_gemv": ([_I32, _VP, _I64, _VP, _I64, _VP, _VP, _I32, _I32, _I32, _I32, _VP], _I32),
    "pagednb_gemv_rms_norm": ([_I32, _VP, _I64, _VP, _I64, _VP, _I64, _VP, _VP, _F32, _F32, _I32, _VP, _VP,
                               _I32, _I32, _I32, _I32, _VP], _I32),
    # fused mixture-of-experts MLP (model/fused_moe.py)
    "pagednb_moe_workspace_bytes": ([_I32, _I32, _I32, _I32, _I32], _I64),
    "pagednb_fused_moe": ([_I32, _VP, _VP, _I64, _VP, _VP, _VP, _VP, _I32, _VP, _I32, _I32, _I32, _I32, _I32, _VP],
                          _I32),
    "pagednb_moe_select_experts": ([_I32, _VP, _I64, _VP, _VP, _I32, _I32, _I32, _I32, _I32, _VP], _I32),
    # tables and status
    "pagednb_dtype_name": ([_I32], ctypes.c_char_p),
    "pagednb_head_dim": ([_I32], _I32),
    "pagednb_max_norm_row_bytes": ([], _I64),
    "pagednb_max_sample_vocab": ([], _I32),
    "pagednb_gemv_max_rows": ([], _I32),
    "pagednb_gemv_max_norm_width": ([], _I32),
    "pagednb_moe_max_experts": ([], _I32),
    "pagednb_moe_max_topk": ([], _I32),
    "pagednb_params_size": ([], _I32),
    "pagednb_pdl_enabled": ([], _I32),
    "pagednb_error_string": ([_I32], ctypes.c_char_p),
}


def declare(lib: ctypes.CDLL) -> None:
    """Sets every function's argtypes and restype on a freshly loaded library."""
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype


def dtype_codes(lib: ctypes.CDLL) -> dict[torch.dtype, int]:
    """The torch dtypes the kernels take, each with the code the C ABI passes for it."""
    codes = {}
    while (name := lib.pagednb_dtype_name(len(codes))) is not None:
        codes[getattr(torch, name.decode())] = len(codes)
    return codes


def head_dims(lib: ctypes.CDLL) -> tuple[int, ...]:
    """The head dims the attention and q/k-norm kernels are built for, ascending."""
    dims: list[int] = []
    while (d := lib.pagednb_head_dim(len(dims))) > 0:
        dims.append(d)
    return tuple(dims)


def check_status(lib: ctypes.CDLL, rc: int, what: str) -> None:
    """Raises RuntimeError naming the failed call and CUDA's message for a nonzero status."""
    if rc != 0:
        raise RuntimeError(f"pagednb CUDA {what} failed: {lib.pagednb_error_string(rc).decode()}")


def current_stream(t: torch.Tensor) -> int:
    """The raw handle of the stream torch would run work on t's device on (capture streams included):
    every launch's last argument."""
    return torch.cuda.current_stream(t.device).cuda_stream


class AttnParams(ctypes.Structure):
    """Mirror of pagednb::AttnParams (kernels_cuda/launchers.h); CudaPagedBackend checks the size against
    pagednb_params_size."""

    _fields_ = [
        ("q", _VP), ("q_stride_tok", _I64), ("q_stride_head", _I64),
        ("cache", _VP), ("v_offset", _I64), ("out", _VP),
        ("part_o", _VP), ("part_ml", _VP), ("part_count", _VP), ("qsl", _VP),
        ("seq_lens", _VP), ("block_tables", _VP), ("row_order", _VP),
        ("bt_stride", _I32), ("num_seqs", _I32), ("num_rows", _I32),
        ("H", _I32), ("Hkv", _I32), ("G", _I32), ("head_groups", _I32),
        ("bs_log2", _I32), ("window", _I32), ("part_size", _I32), ("P", _I32),
        ("decode_only", _I32), ("max_query_len", _I32), ("max_tiles", _I32),
        ("scale_log2", _F32), ("row_variant", _I32), ("softcap_log2", _F32),
        ("cache_fp8", _I32), ("k_scale", _F32), ("v_scale", _F32), ("early_keys", _I32),
        ("fuse_rope", _I32), ("k_new", _VP), ("v_new", _VP),
        ("k_stride_tok", _I64), ("k_stride_head", _I64), ("v_stride_tok", _I64), ("v_stride_head", _I64),
        ("rope_cos", _VP), ("rope_sin", _VP), ("cos_sin_stride", _I64),
        ("q_norm_weight", _VP), ("k_norm_weight", _VP), ("norm_eps", _F32), ("norm_offset", _F32),
        ("norm_in_float32", _I32), ("slots", _VP),
    ]
