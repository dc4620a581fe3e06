"""Temperature sampling (no top-k, top-p or min-p) in one CUDA kernel, and greedy in another.

The sampler draws a row's token by inverse CDF in token-id order with one uniform u per row:
w_j = exp(l_j / T - max(l / T)), and the token is the first j whose running sum of weights reaches
(1 - u) * sum(w). In torch that is a division, a max, an exp, a cumsum and a searchsorted, about eight
passes over the [n, V] float32 logits (155 MB at n = 256, V = 151936: some 0.75 ms a step on an H200).
kernels_cuda/sampling.cu makes the same draw reading each row once, plus one chunk of it; its file
comment has the design and where its rounding differs.

  * `sample_with_temperature_reference` is the torch formula (the sampler's own code path), for tests and
    as the fallback;
  * a row with no valid distribution (a NaN or +inf logit, or all -inf) gets -1 (the sampler's
    INVALID_TOKEN_ID) from either, written with the tokens: the engine reads that flag in the copy of the
    tokens it makes anyway, with no extra synchronisation;
  * `sample_with_temperature` runs the kernel, or returns None when it cannot serve (CPU tensors, the
    library unavailable, a layout it does not take, PAGEDNB_FUSED_OPS=0 read once per process): the
    caller then runs the torch path with the same uniforms, so seeded rows draw the same u either way.

`greedy` is the greedy rows' argmax with the same flag in one launch (kernels_cuda/sampling.cu's end):
torch takes three (max, isfinite, where) after the step's CUDA graph, about 20 us of a batch-1 step
(benchmarks/NOTES.md, issue 14). It returns None where the kernel cannot serve, and the sampler runs that
torch code.

`mask_logits_` applies a structured-output grammar's token bitmask to the logits in place in one launch (-inf
where a bit is 0), for the sampler's `mask_disallowed`.

The kernel paths allocate with torch.empty only and launch on the current stream, so they can be
captured in a CUDA graph.
"""
from __future__ import annotations

import ctypes

import torch

from pagednb.kernels import LazyKernel, check_status, current_stream, dtype_codes


def sample_with_temperature(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor
                            ) -> torch.Tensor | None:
    """Token ids [n] int64 (-1 for rows with no valid distribution) for logits [n, V] float32, bf16 or
    fp16 (rows may be strided, the last dim dense; 16-bit logits are read as they are, which draws what
    their exact float32 copy would), temperature and uniforms [n] or [n, 1] float32 on the same device;
    None when the kernel cannot serve these inputs."""
    if not logits.is_cuda:
        return None
    kernel = KERNEL.enabled()
    return None if kernel is None else kernel.sample(logits, temperature, uniforms)


def greedy(logits: torch.Tensor) -> torch.Tensor | None:
    """Token ids [n] int64 for logits [n, V] float32, bf16 or fp16 (rows may be strided, the last dim dense):
    each row's first index of its max logit (torch's argmax), -1 for a row with a NaN or +inf logit or
    only -inf ones; None when the kernel cannot serve these inputs."""
    if not logits.is_cuda:
        return None
    kernel = KERNEL.enabled()
    return None if kernel is None else kernel.greedy(logits)


def mask_logits_(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """logits [n, V] float32, bf16 or fp16 (rows may be strided, the last dim dense) get -inf in place where
    bitmask ([n, >= ceil(V / 32)] int32 on the same device, rows dense) has a 0 bit; False (nothing done) when
    the kernel cannot serve these inputs."""
    if not logits.is_cuda:
        return False
    kernel = KERNEL.enabled()
    return kernel is not None and kernel.mask(logits, bitmask)


def sample_with_temperature_reference(logits: torch.Tensor, temperature: torch.Tensor,
                                      uniforms: torch.Tensor) -> torch.Tensor:
    """The sampler's torch path for rows without top-k/top-p/min-p."""
    logits = logits / temperature.reshape(-1, 1)
    top = logits.amax(-1, keepdim=True)  # NaN if any logit is
    weights = (logits - top).exp_()  # unnormalised; the top token is 1
    cdf = weights.cumsum_(-1)
    target = (1.0 - uniforms.reshape(-1, 1)) * cdf[:, -1:]
    token_ids = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    return torch.where(top.squeeze(1).isfinite(), token_ids, -1)


class SamplingKernel:
    """ctypes calls into kernels_cuda/sampling.cu. `sample` and `greedy` return None for inputs the kernels
    do not take and raise RuntimeError when a launch fails."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._dtype_codes = dtype_codes(lib)
        self._max_vocab = lib.pagednb_max_sample_vocab()  # the kernel's chunk table (kMaxSampleVocab)

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor
               ) -> torch.Tensor | None:
        code = self._dtype_codes.get(logits.dtype)
        if logits.dim() != 2 or code is None:
            return None
        n, vocab = logits.shape
        if not 0 < vocab <= self._max_vocab or (logits.stride(1) != 1 and vocab > 1) or logits.stride(0) < 0:
            return None
        t_stride, u_stride = _per_row_stride(temperature, logits), _per_row_stride(uniforms, logits)
        if t_stride is None or u_stride is None:
            return None
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
        if n == 0:
            return out
        rc = self._lib.pagednb_sample_temperature(
            code, logits.data_ptr(), logits.stride(0), temperature.data_ptr(), t_stride, uniforms.data_ptr(),
            u_stride, out.data_ptr(), n, vocab, current_stream(logits))
        check_status(self._lib, rc, "sampling")
        return out

    def greedy(self, logits: torch.Tensor) -> torch.Tensor | None:
        code = self._dtype_codes.get(logits.dtype)
        if logits.dim() != 2 or code is None:
            return None
        n, vocab = logits.shape
        if vocab == 0 or (logits.stride(1) != 1 and vocab > 1) or logits.stride(0) < 0:
            return None
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
        if n == 0:
            return out
        rc = self._lib.pagednb_sample_greedy(code, logits.data_ptr(), logits.stride(0), out.data_ptr(), n, vocab,
                                             current_stream(logits))
        check_status(self._lib, rc, "greedy sampling")
        return out


    def mask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
        code = self._dtype_codes.get(logits.dtype)
        if logits.dim() != 2 or bitmask.dim() != 2 or code is None or bitmask.dtype != torch.int32:
            return False
        n, vocab = logits.shape
        if (bitmask.device != logits.device or bitmask.shape[0] != n or bitmask.stride(1) != 1
                or bitmask.shape[1] < -(-vocab // 32) or (logits.stride(1) != 1 and vocab > 1) or logits.stride(0) < 0
                or not 0 < vocab or n > 65535):
            return False
        if n == 0:
            return True
        rc = self._lib.pagednb_mask_logits(code, logits.data_ptr(), logits.stride(0), bitmask.data_ptr(),
                                           bitmask.stride(0), n, vocab, current_stream(logits))
        check_status(self._lib, rc, "grammar bitmask")
        return True


KERNEL = LazyKernel(SamplingKernel)  # made on first use; KERNEL.enabled() is None under PAGEDNB_FUSED_OPS=0


def _per_row_stride(t: torch.Tensor, logits: torch.Tensor) -> int | None:
    """Elements between consecutive rows' values of t ([n] or [n, 1] float32 next to logits), or None."""
    n = logits.shape[0]
    if t.dtype != torch.float32 or t.device != logits.device or t.numel() != n:
        return None
    if t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 1):
        return t.stride(0)
    return None
