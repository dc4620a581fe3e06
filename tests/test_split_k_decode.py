"""Split-K decode attention merged in the decode kernels themselves (kernels_cuda/decode.cuh).

With P > 1 partitions (the kernels' SPLIT instantiations, picked per launch) each CTA that holds keys writes
a partial and counts itself in a per-(row, kv head [x head group]) counter; the last one merges the partials
into the output and resets the counter. The plans here force many small partitions (64 or 32 tokens), so
rows of every length in one batch have from one partition with keys (written directly, the empty rest
skipped) up to dozens merged. Checked: the reference's result within the kernel tests' tolerances; the
counters left zero after every launch (what makes CUDA graph replays safe); a row with one partition of keys
bit-identical to a one-partition launch; a captured graph's replays over new queries bit-identical to eager
launches; the token written by the launch right before a split launch attended to (the split kernels look
rows up and prefetch K/V before their PDL wait).
"""
from __future__ import annotations

import random

import pytest
import torch

from gpu_support import captured, cuda_backend, gpu
from test_cuda_kernels import Case, check


@pytest.fixture(scope="module", params=[2, 1], ids=["rows-tensor-core", "rows-pipelined"])
def backend(request):
    return cuda_backend(request.param)


def force_partitions(monkeypatch, backend, size: int, at_least: int = 1) -> None:
    """Every decode launch split into partitions of `size` tokens (at least `at_least` of them)."""
    real = backend._row_plan

    def plan(*args):
        _, _, groups = real(*args)
        range_max = args[-2]
        return max(-(-range_max // size), at_least), size, groups

    monkeypatch.setattr(backend, "_row_plan", plan)


def counters_are_zero(backend) -> bool:
    torch.cuda.synchronize()
    arrays = [a for per_device in backend._part_counters.values() for a in per_device]
    return bool(arrays) and all(int(a.abs().sum()) == 0 for a in arrays)


# (heads, kv_heads, head_dim, block_size, dtype, window, softcap, partition tokens)
SPLIT = [
    (16, 8, 128, 16, torch.bfloat16, None, None, 64),   # the Qwen3-0.6B shape (row kernel, 2 heads per CTA)
    (32, 8, 64, 16, torch.bfloat16, None, None, 64),    # the Llama-3.2-1B shape (tensor cores under variant 2)
    (4, 1, 256, 16, torch.bfloat16, 512, None, 64),     # the Gemma-3-1B shape, a sliding layer
    (16, 2, 128, 32, torch.float16, None, 3.0, 32),     # 8 heads per CTA, soft-capped
    (8, 2, 128, 16, torch.float32, 100, None, 32),      # float32 rows, a window
    (8, 8, 64, 16, torch.bfloat16, None, None, 32),     # one head per CTA: a merge thread per element
]


@gpu
@pytest.mark.parametrize("case_id", range(len(SPLIT)))
def test_many_partitions_merge_to_the_reference_and_leave_counters_zero(backend, monkeypatch, case_id):
    h, hkv, d, bs, dtype, window, softcap, size = SPLIT[case_id]
    force_partitions(monkeypatch, backend, size)
    rng = random.Random(5000 + case_id)
    seq_lens = [1, size, size + 1, 2500] + [rng.randint(1, 2500) for _ in range(12)]
    case = Case(seq_lens, [1] * len(seq_lens), h, hkv, d, bs, dtype, window, pad_rows=3, seed=5000 + case_id,
                softcap=softcap)
    if softcap:
        case.scale = 0.5  # large raw scores: the cap matters
    check(backend, case)
    assert counters_are_zero(backend), "a launch left a split-K counter nonzero"
    first = backend.attend(case.q, case.kernel_cache, case.md, case.scale, case.window, case.softcap)
    again = backend.attend(case.q, case.kernel_cache, case.md, case.scale, case.window, case.softcap)
    assert torch.equal(first, again), "the merge depends on which partition finished last"
    assert counters_are_zero(backend)


@gpu
def test_a_row_with_one_partition_of_keys_matches_a_one_partition_launch(backend, monkeypatch):
    # rows of at most 64 keys under a plan of 8 partitions of 64: partition 0 writes the output itself,
    # the other 7 exit at once; the same bits as the one-partition plan the engine picks for such rows
    case = Case([1, 17, 64, 40, 63, 2], [1] * 6, 16, 8, 128, 16, torch.bfloat16, seed=77)
    check(backend, case)
    single = backend.attend(case.q, case.kernel_cache, case.md, case.scale, None)
    assert next(iter(case.md._cuda_plan.row_plans.values()))[0] == 1
    del case.md._cuda_plan
    force_partitions(monkeypatch, backend, 64, at_least=8)
    split = backend.attend(case.q, case.kernel_cache, case.md, case.scale, None)
    assert next(iter(case.md._cuda_plan.row_plans.values()))[0] == 8
    assert torch.equal(single, split)


@gpu
def test_graph_replays_of_a_split_launch_match_eager_launches(backend, monkeypatch):
    force_partitions(monkeypatch, backend, 64)
    rng = random.Random(9)
    case = Case([rng.randint(1, 3000) for _ in range(9)], [1] * 9, 32, 8, 64, 16, torch.bfloat16, seed=9)
    check(backend, case)
    graph, out = captured(lambda: backend.attend(case.q, case.kernel_cache, case.md, case.scale, None))
    gen = torch.Generator(device="cuda").manual_seed(10)
    for _ in range(3):
        case.q.copy_(torch.randn(case.q.shape, generator=gen, device="cuda").to(case.q.dtype))
        graph.replay()
        eager = backend.attend(case.q, case.kernel_cache, case.md, case.scale, None)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "a replay differs from an eager launch"
        assert counters_are_zero(backend)


@gpu
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (32, 8, 64)], ids=["qwen3-0.6b", "llama-3.2-1b"])
def test_a_split_launch_attends_to_the_token_written_right_before_it(backend, heads, kv_heads, head_dim):
    # the engine's order inside its decode graph: the step's K/V written, then the attention, each launch free to
    # start before the one before it ends (PDL); a split launch looks its rows up and prefetches their K/V before
    # its wait, so reading the new token before the write landed would show here (k scaled up: it dominates)
    case = Case([700, 130, 1, 2000], [1] * 4, heads, kv_heads, head_dim, 16, torch.bfloat16, seed=31)
    check(backend, case)
    assert next(iter(case.md._cuda_plan.row_plans.values()))[0] > 1, "the engine's plan for 4 rows splits"

    def step():
        backend.write_kv(case.k, case.v, case.kernel_cache, case.md.slot_mapping)
        return backend.attend(case.q, case.kernel_cache, case.md, case.scale, None)

    graph, out = captured(step)
    gen = torch.Generator(device="cuda").manual_seed(32)
    for _ in range(3):
        case.k.copy_(4 * torch.randn(case.k.shape, generator=gen, device="cuda"))
        case.v.copy_(torch.randn(case.v.shape, generator=gen, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        ref = case.reference()
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, f"relative error {rel:.2e}: the new token was read before it was written"
        assert counters_are_zero(backend)
