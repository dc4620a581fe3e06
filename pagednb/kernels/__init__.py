"""pagednb's CUDA kernels from Python: everything between kernels_cuda/ and the code that launches them.

  * jit.py: builds the library once (disk cache; a warning saying why when it cannot) and loads it;
  * abi.py: every ctypes signature, the AttnParams struct, and the tables the C side reports (dtype
    codes, head dims, size limits);
  * lazy.py: `LazyKernel`, one wrapper per process over the library, behind the PAGEDNB_FUSED_OPS switch;
  * qk_rope_rows.py: the rows the q/k norm + RoPE kernels can read (their launch's and the decode prologue's check).

The wrappers themselves stay beside their torch references: attention/cuda_backend.py,
model/fused_ops.py, model/small_linear.py, engine/sampling_kernel.py.
"""
from pagednb.kernels.abi import AttnParams, check_status, current_stream, dtype_codes, head_dims
from pagednb.kernels.jit import kernels_dir, load_error, load_kernels, unavailable_reason
from pagednb.kernels.lazy import LazyKernel

__all__ = ["AttnParams", "LazyKernel", "check_status", "current_stream", "dtype_codes", "head_dims",
           "kernels_dir", "load_error", "load_kernels", "unavailable_reason"]
