"""Programmatic edges into the decode graphs' cuBLAS GEMMs (pagednb/engine/graph_edges.py).

An edge of that kind lets a GEMM start its CTAs while the kernel before it is still running. cuBLAS's Hopper
GEMMs ("nvjet_sm90_...") do not wait (griddepcontrol.wait) before all of their memory accesses: some write
before it (23 of 153 shape and row cases on the H200 wrote over their producer's input), and some read part of
their input before it (Llama-3.2-1B's gate_up at 80 and 200-256 rows, in 10-13 of 20 replays). So the policy
gives the edge only behind pagednb's PdlLate kernels, which let the GEMM launch only by exiting, after a
GPU-wide fence behind their last store. The GPU tests here check that contract for every projection shape of
the benchmark models at 1 to 256 rows, with producers that keep the same rule:
  * the GEMM reads what the kernel before it stored last, right before exiting;
  * the GEMM's output may reuse the memory that kernel read last.

The policy's names and switches are CPU tests.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from gpu_support import CUDA, GPU_REASON
from pagednb.engine.graph_edges import (
    GEMM_PDL_ENV,
    gemm_edge_policy,
    gemm_edge_safe,
    graph_kernel_names,
    make_gemm_edges_programmatic,
    cublas_hopper_gemm,
)
from pagednb.kernels.jit import kernels_dir

LATE_NORM = "_ZN7pagednb12_GLOBAL__N_115rms_norm_kernelI13__nv_bfloat16Li1ELb1ENS_7PdlLateEEEvPT_S5_PKS4_lS7_lS7_iffNS_10NormWeightE"
EARLY_NORM = LATE_NORM.replace("7PdlLate", "8PdlEarly")
GEMM = "nvjet_sm90_tst_64x16_64x16_4x1_v_bz_splitK_TNT"


def test_the_policy_takes_cublas_hopper_gemms_behind_late_triggering_pagednb_kernels_only():
    assert gemm_edge_safe(LATE_NORM, GEMM)
    assert gemm_edge_safe(LATE_NORM, "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT")
    assert not gemm_edge_safe(EARLY_NORM, GEMM)  # it lets the GEMM start before it has read its inputs
    assert not gemm_edge_safe("_ZN8cublasLt19splitKreduce_kernelILi32ELi16Eif13", GEMM)
    assert not gemm_edge_safe("void at::native::vectorized_elementwise_kernel", GEMM)
    for other in ("_ZN8cublasLt19splitKreduce_kernelILi32ELi16Eif13", "nvjet_sm100_tst_128x64_64x8_1x2_h_bz_TNT",
                  "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", LATE_NORM):
        assert not gemm_edge_safe(LATE_NORM, other)


def test_the_switch_is_validated_and_turns_the_edges_off(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(GEMM_PDL_ENV, "yes")
    with pytest.raises(ValueError, match=GEMM_PDL_ENV):
        gemm_edge_policy(cpu)
    monkeypatch.setenv(GEMM_PDL_ENV, "0")
    assert gemm_edge_policy(cpu) is None
    monkeypatch.delenv(GEMM_PDL_ENV)
    assert gemm_edge_policy(cpu) is None  # no GPU: no graphs to rewrite


@pytest.mark.skipif(not CUDA, reason=GPU_REASON)
def test_the_switches_on_the_gpu(monkeypatch):
    dev = torch.device("cuda")
    hopper = torch.cuda.get_device_capability(dev)[0] >= 9
    monkeypatch.delenv(GEMM_PDL_ENV, raising=False)
    monkeypatch.delenv("PAGEDNB_PDL", raising=False)
    assert (gemm_edge_policy(dev) is not None) == hopper
    monkeypatch.setenv("PAGEDNB_PDL", "0")  # every programmatic launch off, the GEMMs' edges too
    assert gemm_edge_policy(dev) is None


_PRODUCERS = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include "common.cuh"
// The engine's PdlLate rule (kernels_cuda/common.cuh): no trigger (the next kernel may launch as the CTAs exit),
// and the engine's GPU-wide release fence behind the last store.
using pagednb::fence_release_gpu;
__device__ void spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}
__global__ void fill_then_exit(__nv_bfloat16* x, int n, float value, long long cycles) {
  spin(cycles);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    x[i] = __float2bfloat16(value);
  fence_release_gpu();
}
__global__ void copy_then_exit(__nv_bfloat16* x, const __nv_bfloat16* b, int n, long long cycles) {
  spin(cycles);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = b[i];
  fence_release_gpu();
}
void fill_launch(torch::Tensor x, double value, int64_t cycles) {
  fill_then_exit<<<132, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<__nv_bfloat16*>(x.data_ptr()), (int)x.numel(), (float)value, (long long)cycles);
}
void copy_launch(torch::Tensor x, torch::Tensor b, int64_t cycles) {
  copy_then_exit<<<132, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<__nv_bfloat16*>(x.data_ptr()), static_cast<const __nv_bfloat16*>(b.data_ptr()), (int)x.numel(),
      (long long)cycles);
}
"""

# (N, K) of every decode projection of the benchmark shapes (Qwen3-0.6B, Llama-3.2-1B)
SHAPES = {"qwen3 qkv": (4096, 1024), "qwen3 o": (1024, 2048), "qwen3 gate_up": (6144, 1024),
          "qwen3 down": (1024, 3072), "llama qkv": (3072, 2048), "llama o": (2048, 2048),
          "llama gate_up": (16384, 2048), "llama down": (2048, 8192)}


@pytest.fixture(scope="module")
def producer():
    if not CUDA or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a Hopper GPU (programmatic edges); " + GPU_REASON)
    from torch.utils.cpp_extension import load_inline
    return load_inline("pagednb_test_fenced_producers",
                       "void fill_launch(torch::Tensor x, double value, int64_t cycles);\n"
                       "void copy_launch(torch::Tensor x, torch::Tensor b, int64_t cycles);",
                       cuda_sources=_PRODUCERS, functions=["fill_launch", "copy_launch"],
                       extra_cuda_cflags=["-gencode=arch=compute_90,code=sm_90", "--expt-relaxed-constexpr"],
                       extra_include_paths=[str(kernels_dir())])


ROWS = (1, 2, 3, 8, 16, 48, 64, 80, 112, 128, 144, 200, 208, 240, 256)
REPLAYS = 10


def _any_source(source: str, gemm: str) -> bool:  # the producers here are not pagednb kernels
    return cublas_hopper_gemm(gemm)


def _check_with_programmatic_edge(record: Callable[[], torch.Tensor], reset: Callable[[], object],
                                  expected: torch.Tensor, what: str) -> None:
    """Captures record() (a producer, then a GEMM; returns the GEMM's output) in a graph, turns the edge into the
    GEMM programmatic, and replays it REPLAYS times, each after reset(), checking the output."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        out = record()
    names = graph_kernel_names(graph.raw_cuda_graph())
    gemms = [k for k in names if cublas_hopper_gemm(k)]
    assert gemms, f"{what} ran no kernel the policy names: {names}"
    assert make_gemm_edges_programmatic(graph.raw_cuda_graph(), _any_source) == 1
    graph.instantiate()
    for _ in range(REPLAYS):
        reset()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected), f"{what}: a wrong output ({gemms})"


def _weight(shape: str, seed: int) -> torch.Tensor:
    N, K = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) / 32


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_gemm_behind_a_late_trigger_reads_what_that_kernel_stored_last(producer, shape):
    weight = _weight(shape, 0)
    for rows in ROWS:
        x = torch.zeros(rows, weight.shape[1], device="cuda", dtype=torch.bfloat16)
        expected = F.linear(torch.ones_like(x), weight)
        F.linear(x, weight)  # cuBLAS's handle and workspace before the capture

        def record():
            producer.fill_launch(x, 1.0, 20_000)  # writes x right before its CTAs exit
            return F.linear(x, weight)
        _check_with_programmatic_edge(record, x.zero_, expected, f"{shape} at {rows} rows (reading its input)")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_gemm_behind_a_late_trigger_may_write_where_that_kernel_read(producer, shape):
    weight = _weight(shape, 1)
    N, K = weight.shape
    for rows in ROWS:
        source = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
        storage = torch.empty(rows * max(K, N), device="cuda", dtype=torch.bfloat16)
        b, out = storage[:rows * K].view(rows, K), storage[:rows * N].view(rows, N)  # the output overlaps b
        x = torch.zeros(rows, K, device="cuda", dtype=torch.bfloat16)
        expected = torch.mm(source, weight.t())
        torch.mm(x, weight.t())

        def record():
            producer.copy_launch(x, b, 400_000)  # reads b ~200 us in, then exits
            return torch.mm(x, weight.t(), out=out)
        _check_with_programmatic_edge(record, lambda: b.copy_(source), expected,
                                      f"{shape} at {rows} rows (writing over its producer's input)")
