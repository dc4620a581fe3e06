"""What the GPU tests share: the skip marker for machines without a CUDA GPU, and the loaded kernels.

On a CPU (CI) every GPU test is skipped with GPU_REASON. On a GPU the kernels must build: a failed build
fails the tests that need them (with load_error()'s reason), it never skips them.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import pytest
import torch

CUDA = torch.cuda.is_available()
GPU_REASON = "needs a CUDA GPU (the kernels run on the H200 device); CPU CI skips"
gpu = pytest.mark.skipif(not CUDA, reason=GPU_REASON)

K = TypeVar("K")


def built_kernels(get: Callable[[], K | None]) -> K:
    """get()'s kernels on a GPU (asserting they built); skips the test on a CPU."""
    if not CUDA:
        pytest.skip(GPU_REASON)
    found = get()
    if found is None:
        from pagednb.kernels import load_error
        pytest.fail(f"pagednb's CUDA kernels did not build: {load_error()}")
    return found


def cuda_backend(row_variant: int):
    """The CUDA attention backend on the built kernels (skips on a CPU) with this decode-row variant (4, the
    default, and 2: tensor cores where they apply (4 also for an fp8 cache with 2-3 query heads per kv head at
    head_dim 128), else as 1; 1: the row kernel's cp.async ring; 0: direct loads)."""
    from pagednb.attention.cuda_backend import CudaPagedBackend
    from pagednb.kernels import load_kernels
    backend = CudaPagedBackend(built_kernels(load_kernels))
    backend.row_variant = row_variant
    return backend


R = TypeVar("R")


def captured(call: Callable[[], R], warm_up: Callable[[], object] | None = None) -> tuple[torch.cuda.CUDAGraph, R]:
    """A CUDA graph of call() and what the captured call returned, after one warm-up (warm_up, else call itself)
    on a side stream, as torch asks before a capture (one-time kernel attributes, allocator pools)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (warm_up or call)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = call()
    return graph, result
