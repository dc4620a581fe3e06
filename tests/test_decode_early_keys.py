"""Decode attention reads before its PDL wait only what no kernel of the step still writes.

A decode CTA looks up its row and starts copying keys from the cache before griddepcontrol.wait, while the kernel
ahead of it (the q/k norm + RoPE + cache write) runs (kernels_cuda/decode.cuh, Keys): the keys of earlier steps
only; the new tokens' keys and the queries are read after the wait. Checked with a producer that makes that race
long and certain: it lets the next kernel launch at once, spins ~1.5 ms, then writes the step's queries and the
new tokens' keys and values, whose slots held other values until then. A decode launch right behind it must give
every row the bits of a launch over the finished data. A control shows the race happened: the producer also
rewrites one key of an earlier step (the first key of a row launched first), and a one-partition launch, which
copies that key before its wait, reads the old value in that row only (a split launch copies after its wait).
Rows of 1 key (only the new token), a few keys (the new token in a ring stage copied around the wait) and up to
~1,500; the row kernel (Qwen3-0.6B's heads), the 16-bit tensor-core kernel (Llama-3.2-1B's) and the fp8
tensor-core kernel (Qwen3's heads over an fp8 cache), in one partition and split; longest first (the order read
before the wait) and in batch order.

GPU only, Hopper or later (programmatic dependent launch); skipped elsewhere.
"""
from __future__ import annotations

import ctypes
import random
import subprocess
from pathlib import Path

import pytest
import torch

from gpu_support import CUDA, GPU_REASON, cuda_backend
from pagednb.attention.cuda_backend import ORDER_MIN_ROWS
from test_cuda_kernels import Case

_PRODUCER = r"""
// Lets the next kernel launch at once, spins, then copies two buffers (16-byte units) and exits.
__global__ void late_copy(int4* a, const int4* a_src, long long na, int4* b, const int4* b_src, long long nb,
                          long long cycles) {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const long long start = clock64();
  while (clock64() - start < cycles) {}
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < na; i += stride) a[i] = a_src[i];
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < nb; i += stride) b[i] = b_src[i];
}

extern "C" int late_copy_launch(void* a, const void* a_src, long long na, void* b, const void* b_src, long long nb,
                                long long cycles, void* stream) {
  late_copy<<<8, 256, 0, (cudaStream_t)stream>>>((int4*)a, (const int4*)a_src, na, (int4*)b, (const int4*)b_src, nb,
                                                 cycles);
  return (int)cudaGetLastError();
}
"""

SPIN_CYCLES = 3_000_000  # ~1.5 ms at the H200's clock: far longer than the host takes to launch the attention
RACES = 5


class _Producer:
    """late_copy from a shared library of its own (nvcc, seconds; no torch extension), on torch's current stream."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._launch = lib.late_copy_launch
        self._launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_void_p]

    def late_copy(self, a: torch.Tensor, a_src: torch.Tensor, b: torch.Tensor, b_src: torch.Tensor) -> None:
        assert a.nbytes == a_src.nbytes and b.nbytes == b_src.nbytes and a.nbytes % 16 == 0 == b.nbytes % 16
        rc = self._launch(a.data_ptr(), a_src.data_ptr(), a.nbytes // 16, b.data_ptr(), b_src.data_ptr(),
                          b.nbytes // 16, SPIN_CYCLES, torch.cuda.current_stream().cuda_stream)
        assert rc == 0, f"late_copy launch failed ({rc})"


@pytest.fixture(scope="module")
def producer(tmp_path_factory):
    if not CUDA or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a Hopper GPU (programmatic dependent launch); " + GPU_REASON)
    from torch.utils.cpp_extension import CUDA_HOME
    out = tmp_path_factory.mktemp("late_copy")
    (out / "late_copy.cu").write_text(_PRODUCER)
    nvcc = str(Path(CUDA_HOME, "bin", "nvcc")) if CUDA_HOME else "nvcc"
    subprocess.run([nvcc, "-O2", "-gencode=arch=compute_90,code=sm_90", "-shared", "-Xcompiler", "-fPIC",
                    "-o", str(out / "late_copy.so"), str(out / "late_copy.cu")], check=True)
    return _Producer(ctypes.CDLL(str(out / "late_copy.so")))


# (rows, heads, kv_heads, head_dim, fp8 cache, forced partition tokens)
CASES = {
    "qwen3 rows": (64, 16, 8, 128, False, None),
    "qwen3 rows split": (40, 16, 8, 128, False, 64),
    "llama tensor cores": (64, 32, 8, 64, False, None),
    "llama tensor cores split": (40, 32, 8, 64, False, 64),
    "qwen3 fp8 tensor cores": (96, 16, 8, 128, True, None),
    "qwen3 fp8 tensor cores split": (40, 16, 8, 128, True, 64),
    "few rows (batch order)": (8, 16, 8, 128, False, None),
}


def _lengths(rows: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    lens = [rng.randint(1, 1500) for _ in range(rows)]
    lens[:4] = [1, 5, 17, 130]  # the new token alone, in the first tile, in the second, past the first ring stages
    return lens


def _full_cache(case: Case, fp8: bool) -> torch.Tensor:
    """The step's cache once the new tokens are written (released blocks NaN), 16-bit or as fp8 bytes."""
    from pagednb.attention.kv_quant import FP8_DTYPE, quantize
    cache = case.expected_cache()
    cache[:, case.poisoned] = float("nan")
    if not fp8:
        return cache
    return torch.stack([quantize(cache[0], 0.5).view(torch.uint8),
                        quantize(cache[1], 2.0).view(torch.uint8)]).view(FP8_DTYPE)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("longest_first", [True, False], ids=["longest-first", "batch-order"])
def test_a_launch_behind_the_cache_write_reads_the_new_keys_after_its_wait(producer, name, longest_first):
    rows, h, hkv, d, fp8, split = CASES[name]
    backend = cuda_backend(4)
    backend.longest_first = longest_first
    backend.split_tokens = backend.tail_tokens = split
    case = Case(_lengths(rows, rows + h), [1] * rows, h, hkv, d, 16, torch.bfloat16, seed=rows + d)
    scales = (0.5, 2.0) if fp8 else (1.0, 1.0)
    full = _full_cache(case, fp8)
    raw_full = full.view(torch.uint8)

    backend.early_keys = False  # the plan (and the sort) made here; every read after the wait
    expected = backend.attend(case.q, full, case.md, case.scale, None, None, *scales)
    torch.cuda.synchronize()
    assert not expected.isnan().any()
    plan = case.md._cuda_plan
    if split:
        assert next(iter(plan.row_plans.values()))[0] > 1, "the forced split did not apply"

    backend.early_keys = True
    lens = case.md.seq_lens
    first = int(lens.argmax()) if longest_first and rows >= ORDER_MIN_ROWS else 3  # a row launched first, 130 keys
    old_slot = int(case.block_tables[first, 0]) * 16  # its key 0, written by an earlier step
    late = torch.cat([case.md.slot_mapping, torch.tensor([old_slot], device="cuda")])
    one_partition = next(iter(plan.row_plans.values()))[0] == 1
    for race in range(RACES):
        # the late slots hold other values until the producer writes them (as bytes: torch's CUDA indexing
        # kernels skip fp8 types)
        raw = raw_full.clone()
        raw.view(2, -1, hkv * d * full.element_size())[:, late] = (race * 37 + 11) % 256
        q = torch.full_like(case.q, 3.0)
        producer.late_copy(raw, raw_full, q, case.q.contiguous())
        out = backend.attend(q, raw.view(full.dtype), case.md, case.scale, None, None, *scales)
        torch.cuda.synchronize()
        assert case.md._cuda_plan is plan, "a new plan (a sort launched between the producer and the attention)"
        differs = (out != expected).flatten(1).any(dim=1)
        others = torch.ones(rows, dtype=torch.bool, device="cuda")
        others[first] = False
        assert not differs[others].any(), \
            f"{name}, race {race}: rows {differs.nonzero().flatten().tolist()} read data before the producer wrote it"
        assert bool(differs[first]) == one_partition, (
            f"{name}, race {race}: the control row read its old key "
            + ("after the producer wrote it: the launch did not overlap the producer, so this test shows nothing"
               if one_partition else "before its wait, which a split launch must not do"))
