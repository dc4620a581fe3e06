"""The decode kernels' launch order: decode steps of ORDER_MIN_ROWS rows or more run their rows longest first.

CudaPagedBackend sorts a step's sequence lengths on the device (once per step, recorded in the decode CUDA graphs)
and the row kernel, like the tensor-core decode kernel, takes its row from that order by its grid position
(kernels_cuda/decode.cuh, "Launch order").
Checked: a sorted launch matches the reference and is bit-identical to the same launch in batch order (a CTA's
work does not depend on when it runs), with one-partition and split-K launches (whose counters are indexed by the
CTA's grid position), two CTAs per kv head, a sliding window, float32 rows, the tensor-core kernel (Llama-3.2-1B's
heads) and an fp8 cache (one kv head per CTA, two under row variant 3, with an odd number of kv heads among the
cases, and the tensor-core kernel for 2-4 query heads per kv head under variants 2 and 4); a captured graph's sort
follows the lengths of each replay; steps the order does not apply to (prefill chunks, few rows) launch in batch
order; a launch of more rows than gridDim.y holds continues along x (both kernels), split launches included.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from gpu_support import captured, cuda_backend, gpu
from test_cuda_kernels import Case, check


@pytest.fixture(scope="module", params=[2, 1], ids=["rows-variant-2", "rows-pipelined"])
def backend(request):
    return cuda_backend(request.param)


@pytest.fixture(autouse=True)
def engine_knobs(request):
    """Each test starts from the engine's launch plan (longest first, no forced split) and leaves the row variant
    as it found it."""
    backend = request.getfixturevalue("backend") if "backend" in request.fixturenames else None
    if backend is None:
        yield
        return
    backend.longest_first, backend.split_tokens, backend.tail_tokens = True, None, None
    variant = backend.row_variant
    yield
    backend.row_variant = variant


def row_order(md):
    """The order the step's row-kernel launch used (None: batch order)."""
    return md._cuda_plan.order


def counters_are_zero(backend) -> bool:
    torch.cuda.synchronize()
    return all(int(a.abs().sum()) == 0 for arrays in backend._part_counters.values() for a in arrays)


def attend_in(backend, case: Case, longest_first: bool, k_scale: float = 1.0, v_scale: float = 1.0,
              cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's output and order, planned anew with the order switched on or off."""
    backend.longest_first = longest_first
    case.md._cuda_plan = None
    out = backend.attend(case.q, case.kernel_cache if cache is None else cache, case.md, case.scale, case.window,
                         case.softcap, k_scale, v_scale)
    torch.cuda.synchronize()
    return out, row_order(case.md)


def mixed_lens(rng: random.Random, rows: int, longest: int) -> list[int]:
    lens = [rng.randint(1, longest) for _ in range(rows)]
    lens[rows // 2] = longest  # the longest row in the middle of the batch: sorting moves it
    return lens


# (rows, heads, kv_heads, head_dim, block_size, dtype, window)
SORTED = [
    (64, 16, 8, 128, 16, torch.bfloat16, None),     # the Qwen3-0.6B shape (2 heads per CTA)
    (40, 16, 1, 128, 16, torch.bfloat16, None),     # 16 heads per kv head at head_dim 128: two CTAs of 8 each
    (48, 4, 1, 256, 16, torch.bfloat16, 300),       # the Gemma-3-1B shape, a sliding layer
    (33, 8, 2, 64, 32, torch.float32, None),        # float32 rows
    (64, 32, 8, 64, 16, torch.bfloat16, None),      # Llama-3.2-1B: the tensor-core kernel under variant 2
]


@gpu
@pytest.mark.parametrize("split_tokens", [None, 64], ids=["one-partition", "split"])
@pytest.mark.parametrize("case_id", range(len(SORTED)))
def test_longest_first_matches_the_reference_and_batch_order_bit_for_bit(backend, case_id, split_tokens):
    rows, h, hkv, d, bs, dtype, window = SORTED[case_id]
    backend.split_tokens = backend.tail_tokens = split_tokens  # every launch split, whatever the planner's choice
    case = Case(mixed_lens(random.Random(case_id), rows, 1500), [1] * rows, h, hkv, d, bs, dtype, window,
                pad_rows=2, seed=600 + case_id)
    backend.longest_first = True
    check(backend, case)
    if split_tokens:
        assert next(iter(case.md._cuda_plan.row_plans.values()))[0] > 1, "the forced split did not apply"
    sorted_out, order = attend_in(backend, case, True)
    lens = case.md.seq_lens.long()
    assert order is not None, "a decode step of this many rows is launched longest first"
    assert sorted(order.tolist()) == list(range(rows)) and bool((lens[order].diff() <= 0).all())
    batch_out, none = attend_in(backend, case, False)
    assert none is None
    assert torch.equal(sorted_out, batch_out), "a row's result depends on the launch order"
    assert counters_are_zero(backend), "a split launch left a counter nonzero"


# (rows, heads, kv_heads, forced partition tokens): over an fp8 cache at head_dim 128, kv heads with at most 2 query
# heads run in pairs per CTA under row variant 3 (launchers.h row_kv_per_cta), one per CTA under 2 and 1, on the
# tensor-core kernel under 4 (2 query heads and more, a kv-head pair per CTA in one-partition launches); 4 query
# heads per kv head take the tensor-core kernel under 2 and 4
FP8 = [
    (80, 32, 8, None),   # 4 query heads per kv head
    (40, 32, 8, 64),     # the same, split into many partitions
    (96, 16, 8, None),   # Qwen3-0.6B's heads: pairs of kv heads, 2 query heads each
    (64, 8, 8, None),    # one query head per kv head: pairs
    (48, 6, 3, None),    # an odd number of kv heads: one per CTA
    (40, 16, 8, 64),     # pairs, split into many partitions
    (6, 16, 8, None),    # few rows: batch order, the planner's split
]


@gpu
@pytest.mark.parametrize("variant", [None, 3, 4, 5], ids=["variant", "variant-3", "variant-4", "variant-5"])
@pytest.mark.parametrize("case_id", range(len(FP8)))
def test_an_fp8_cache_matches_the_reference_and_batch_order(backend, case_id, variant):
    from test_fp8_kv_cache import check_fp8

    from pagednb.attention.cuda_backend import ORDER_MIN_ROWS
    from pagednb.attention.kv_quant import FP8_DTYPE, quantize
    rows, h, hkv, split = FP8[case_id]
    if variant is not None:
        backend.row_variant = variant  # the fixture's variant is restored after the test
    backend.split_tokens = backend.tail_tokens = split
    case = Case(mixed_lens(random.Random(70 + case_id), rows, 2000), [1] * rows, h, hkv, 128, 16, torch.bfloat16,
                pad_rows=1, seed=70 + case_id)
    check_fp8(backend, case, 0.5, 2.0)
    assert counters_are_zero(backend)
    cache = torch.stack([quantize(case.cache[0], 0.5).view(torch.uint8),
                         quantize(case.cache[1], 2.0).view(torch.uint8)]).view(FP8_DTYPE)
    sorted_out, order = attend_in(backend, case, True, 0.5, 2.0, cache)
    batch_out, _ = attend_in(backend, case, False, 0.5, 2.0, cache)
    assert (order is not None) == (rows >= ORDER_MIN_ROWS)
    assert torch.equal(sorted_out, batch_out)
    assert counters_are_zero(backend)


@gpu
@pytest.mark.parametrize("case_id", range(len(FP8)))
def test_the_lean_fp8_ring_gives_variant_4s_bits(backend, case_id):
    # row variant 5 differs from 4 only in the fp8 two-head CTA's ring (two stages of 16 tokens per warp, not
    # three) and its register cap (three CTAs per SM): the same tiles per warp, added in the same order
    from pagednb.attention.kv_quant import FP8_DTYPE, quantize
    rows, h, hkv, split = FP8[case_id]
    backend.split_tokens = backend.tail_tokens = split
    case = Case(mixed_lens(random.Random(90 + case_id), rows, 2000), [1] * rows, h, hkv, 128, 16, torch.bfloat16,
                pad_rows=1, seed=90 + case_id)
    cache = torch.stack([quantize(case.cache[0], 0.5).view(torch.uint8),
                         quantize(case.cache[1], 2.0).view(torch.uint8)]).view(FP8_DTYPE)
    outs = {}
    for variant in (4, 5):
        backend.row_variant = variant  # the fixture's variant is restored after the test
        outs[variant], _ = attend_in(backend, case, True, 0.5, 2.0, cache)
    assert torch.equal(outs[4], outs[5])
    assert counters_are_zero(backend)


@gpu
def test_a_captured_graph_sorts_the_lengths_of_each_replay(backend):
    # the engine's decode graphs are captured once and replayed with each step's lengths written in place: the sort
    # must be recorded in the graph (planned inside the capture), not read from the capture's lengths
    rng = random.Random(11)
    rows = 40
    case = Case(mixed_lens(rng, rows, 1200), [1] * rows, 16, 8, 128, 16, torch.bfloat16, seed=11)
    check(backend, case)
    case.md._cuda_plan = None
    backend.longest_first = True

    def call():
        return backend.attend(case.q, case.kernel_cache, case.md, case.scale, None)

    graph, out = captured(call, warm_up=lambda: backend.attend(case.q, case.kernel_cache, replace(case.md),
                                                               case.scale, None))
    order = row_order(case.md)
    assert order is not None
    full = case.md.seq_lens.tolist()
    for _ in range(3):
        new = [rng.randint(1, n) for n in full]  # shorter: their blocks are in the tables already
        case.md.seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        lens = torch.tensor(new, device="cuda")
        assert sorted(order.tolist()) == list(range(rows)) and bool((lens[order].diff() <= 0).all()), \
            "the replay launched the rows in the capture's order, not longest first"
        md = replace(case.md, seq_lens=case.md.seq_lens.clone())  # planned as captured: for the longest of `full`
        eager = backend.attend(case.q, case.kernel_cache, md, case.scale, None)
        assert torch.equal(out, eager), "a replay differs from an eager launch over the same lengths"


@gpu
def test_steps_the_order_does_not_apply_to_launch_in_batch_order(backend):
    from pagednb.attention.cuda_backend import ORDER_MIN_ROWS
    backend.longest_first = True
    rng = random.Random(3)
    few = Case(mixed_lens(rng, ORDER_MIN_ROWS - 1, 900), [1] * (ORDER_MIN_ROWS - 1), 16, 8, 128, 16,
               torch.bfloat16, seed=3)
    check(backend, few)
    assert row_order(few.md) is None, "too few rows to sort"
    enough = Case(mixed_lens(rng, ORDER_MIN_ROWS, 900), [1] * ORDER_MIN_ROWS, 16, 8, 128, 16, torch.bfloat16,
                  seed=4)
    check(backend, enough)
    assert row_order(enough.md) is not None
    # a step with a prefill chunk: rows are not one per sequence
    lens = mixed_lens(rng, 40, 900)
    lens[-1] = 100
    mixed = Case(lens, [1] * 39 + [50], 16, 8, 128, 16, torch.bfloat16, seed=5)
    check(backend, mixed)
    assert row_order(mixed.md) is None, "a step with a prefill chunk is launched in batch order"
    # Llama-3.2-1B's heads: the tensor-core kernel under variant 2, the row kernel under 1, sorted alike
    llama = Case(mixed_lens(rng, 64, 900), [1] * 64, 32, 8, 64, 16, torch.bfloat16, seed=6)
    check(backend, llama)
    assert row_order(llama.md) is not None


@gpu
@pytest.mark.parametrize("heads, head_dim", [(2, 16), (4, 64)], ids=["row-kernel", "tensor-cores-under-variant-2"])
def test_more_rows_than_grid_y_holds_continue_along_x(backend, heads, head_dim):
    # 70,000 decode rows (unsorted: past GRID_ROWS) of a tiny shape: rows 65,535 on run in a second block of
    # head columns; every row must match the reference, none left unwritten
    from pagednb.attention.cuda_backend import GRID_ROWS
    rows = 70_000
    assert rows > GRID_ROWS
    rng = random.Random(13)
    case = Case([rng.randint(1, 40) for _ in range(rows)], [1] * rows, heads, 1, head_dim, 16, torch.bfloat16,
                seed=13)
    check(backend, case)
    assert row_order(case.md) is None


@gpu
def test_a_split_decode_launch_beside_more_prefill_rows_than_grid_y_holds(backend):
    # 8 decode rows (the planner splits them) beside 700 prefill chunks: 70,008 rows in the row kernel's grid, the
    # split-K counters indexed across two blocks of rows (a step of max_num_batched_tokens above 65,535)
    from pagednb.attention.cuda_backend import GRID_ROWS
    rng = random.Random(17)
    chunks, decodes = 700, 8
    query_lens = [100] * chunks + [1] * decodes
    seq_lens = [100 + rng.randint(0, 50) for _ in range(chunks)] + [rng.randint(500, 3000) for _ in range(decodes)]
    case = Case(seq_lens, query_lens, 2, 1, 16, 16, torch.bfloat16, seed=17)
    assert case.rows > GRID_ROWS
    check(backend, case)
    assert next(iter(case.md._cuda_plan.row_plans.values()))[0] > 1, "the decode rows are split"
    assert counters_are_zero(backend)


def test_the_row_variant_knob_is_read_from_the_environment_and_checked(monkeypatch):
    # PAGEDNB_ROW_VARIANT picks the decode kernels' variant for A/B runs of a whole engine
    # (benchmarks/whole_run_ab.py); unset, the default; anything else is refused, naming the variable
    from pagednb.attention.cuda_backend import DEFAULT_ROW_VARIANT, row_variant_from_env
    monkeypatch.delenv("PAGEDNB_ROW_VARIANT", raising=False)
    assert row_variant_from_env() == DEFAULT_ROW_VARIANT == 5
    monkeypatch.setenv("PAGEDNB_ROW_VARIANT", "2")
    assert row_variant_from_env() == 2
    for bad in ("6", "-1", "two", "2.0"):
        monkeypatch.setenv("PAGEDNB_ROW_VARIANT", bad)
        with pytest.raises(ValueError, match="PAGEDNB_ROW_VARIANT must be one of"):
            row_variant_from_env()
