"""The step's q/k norm + rotary embedding and K/V cache write inside the decode launch (`attend_rope`).

In a decode-only step over an fp8 cache, the tensor-core decode kernel (kernels_cuda/decode_group_mma.cuh) takes
the raw q/k/v projections: each CTA norms and rotates its own query heads into shared memory and, in the CTA whose
keys hold the row's new token, writes that token's K (normed, rotated, quantised) and V into the cache before its
ring reads them (kernels_cuda/decode.cuh, FusedRope). That replaces qk_norm_rope's launch per layer, and must give
its bits: the attention output and every cache byte equal those of the separate launch followed by `attend`, for
Qwen3's shape (two kv heads per CTA), Llama 3.2's (head_dim 64, no norm), 9-16 query heads per kv head, an odd
number of kv heads, split-K partitions, sliding windows, padding rows, both 16-bit dtypes and every norm style,
and in CUDA graph replays. Everything else (a prefill chunk in the step, a 16-bit cache, soft-capping, partial
rotary, unaligned rows, PAGEDNB_FUSE_ROPE=0) is declined (None), and the caller runs the ops itself. End to end, an
engine's greedy tokens and logprobs are the same with the fusion and without it.
"""
from __future__ import annotations

import random

import pytest
import torch

from gpu_support import built_kernels, captured, cuda_backend, gpu
from test_cuda_kernels import Case
from test_fused_ops import rope_tables

from pagednb import LLM, SamplingParams
from pagednb.attention import TorchReferenceBackend
from pagednb.attention.backend import RopeInputs
from pagednb.attention.cuda_backend import DEFAULT_FUSE_ROPE_SPLIT_WAVES, DEFAULT_ROW_VARIANT, CudaPagedBackend
from pagednb.attention.kv_quant import FP8_DTYPE, quantize


def rope_inputs(case: Case, seed: int, norm: bool = True, weight_offset: float | None = None) -> RopeInputs:
    gen = torch.Generator().manual_seed(seed)
    n, d = case.q.shape[0], case.q.shape[2]
    cos, sin = rope_tables(n, d, case.dtype, gen, device="cuda")
    weights = [(torch.randn(d, generator=gen) * 0.5 + (0 if weight_offset else 1)).to("cuda", case.dtype)
               for _ in range(2)] if norm else [None, None]
    return RopeInputs(cos, sin, *weights, 1e-6, weight_offset)


def fp8_cache(case: Case, k_scale: float, v_scale: float) -> torch.Tensor:
    return torch.stack([quantize(case.cache[0], k_scale).view(torch.uint8),
                        quantize(case.cache[1], v_scale).view(torch.uint8)]).view(FP8_DTYPE)


def separate_launches(backend, case: Case, rope: RopeInputs, cache: torch.Tensor, k_scale: float, v_scale: float):
    """What the model runs without the fusion: qk_norm_rope_write_kv's launch (in place on q and k), then attend."""
    from pagednb.model import fused_ops
    got = fused_ops.qk_norm_rope_write_kv(case.q, case.k, case.v, rope.cos, rope.sin, rope.q_weight, rope.k_weight,
                                          rope.eps, cache, case.md.slot_mapping, weight_offset=rope.weight_offset,
                                          kv_scales=(k_scale, v_scale))
    assert got is not None, "the separate launch declined these inputs"
    return backend.attend(got[0], cache, case.md, case.scale, case.window, case.softcap, k_scale, v_scale)


def reference(case: Case, rope: RopeInputs, cache: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    from pagednb.model.fused_ops import qk_norm_rope_reference
    q, k = qk_norm_rope_reference(case.q, case.k, rope.cos, rope.sin, rope.q_weight, rope.k_weight, rope.eps,
                                  rope.weight_offset)
    ref = TorchReferenceBackend()
    ref.write_kv(k, case.v, cache, case.md.slot_mapping, k_scale, v_scale)
    return ref.attend(q.float(), cache, case.md, case.scale, case.window, case.softcap, k_scale, v_scale)


def check_fused(backend, case: Case, rope: RopeInputs, k_scale: float = 0.5, v_scale: float = 2.0) -> torch.Tensor:
    """attend_rope against the separate launches on copies of one fp8 cache: the same output and cache bytes; the
    projections left as they were; and the reference's result within the fp8 kernels' tolerance."""
    cache = fp8_cache(case, k_scale, v_scale)
    fused_cache, separate_cache, ref_cache = cache.clone(), cache.clone(), cache.clone()
    inputs = [t.clone() for t in (case.q, case.k, case.v)]
    out = backend.attend_rope(case.q, case.k, case.v, fused_cache, case.md, case.scale, case.window, case.softcap,
                              k_scale, v_scale, rope)
    assert out is not None, "attend_rope declined a step it should fuse"
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(inputs, (case.q, case.k, case.v))), "the projections changed"
    want = separate_launches(backend, case, rope, separate_cache, k_scale, v_scale)
    for t, before in zip((case.q, case.k), inputs):  # the separate launch rotated q and k in place: put them back
        t.copy_(before)
    assert torch.equal(fused_cache.view(torch.uint8), separate_cache.view(torch.uint8)), "cache bytes differ"
    assert torch.equal(out, want), "the fused launch's output differs from the separate launches'"
    ref = reference(case, rope, ref_cache, k_scale, v_scale)
    o, r = out[:case.rows].float(), ref[:case.rows].float()
    assert ((o - r).norm() / r.norm()).item() < 1e-2
    assert not out[case.rows:].any(), "padding rows are not zero"
    return fused_cache


# (rows, max_len, heads, kv_heads, head_dim, block_size, dtype, window, pad_rows, norm style)
CASES = {
    "qwen3-0.6b": (256, 1024, 16, 8, 128, 16, torch.bfloat16, None, 0, "llama"),  # two kv heads per CTA, sorted
    "qwen3-0.6b-split": (1, 20000, 16, 8, 128, 16, torch.bfloat16, None, 0, "llama"),  # split-K partitions
    "llama-3.2-1b": (64, 3000, 32, 8, 64, 16, torch.bfloat16, None, 3, None),  # head_dim 64, no norm, padding
    "12-per-kv-head": (9, 3000, 24, 2, 128, 16, torch.float16, None, 0, "gemma"),  # a second column tile
    "odd-kv-heads-window": (40, 2500, 12, 3, 64, 32, torch.float16, 700, 0, "olmo"),  # one kv head per CTA
    "16-per-kv-head-split": (3, 9000, 16, 1, 64, 16, torch.bfloat16, None, 2, "llama"),
}
NORM_OFFSETS = {"llama": None, "gemma": 1.0, "olmo": 0.0}  # the weight as Llama applies it, or in float32 (+ offset)


def make_case(case_id: str, seed: int) -> tuple[Case, RopeInputs]:
    rows, max_len, h, hkv, d, bs, dtype, window, pad, style = CASES[case_id]
    rng = random.Random(seed)
    seq_lens = [rng.randint(1, max_len) for _ in range(rows)]
    seq_lens[0] = max_len
    if rows > 1:
        seq_lens[1] = 1
    case = Case(seq_lens, [1] * rows, h, hkv, d, bs, dtype, window, pad_rows=pad, fused_qkv=True, seed=seed)
    return case, rope_inputs(case, seed, norm=style is not None, weight_offset=NORM_OFFSETS.get(style))


def fusing_backend():
    """The CUDA backend fusing every launch the kernel can take (the policy's limits lifted: the kernel's tests)."""
    backend = cuda_backend(DEFAULT_ROW_VARIANT)
    backend.fuse_rope_waves, backend.fuse_rope_split = float("inf"), (0.0, float("inf"))
    return backend


@gpu
@pytest.mark.parametrize("case_id", list(CASES))
def test_fused_decode_gives_the_separate_launches_bits(case_id):
    backend = fusing_backend()
    case, rope = make_case(case_id, seed=3000 + list(CASES).index(case_id))
    check_fused(backend, case, rope)


@gpu
@pytest.mark.parametrize("case_id", ["qwen3-0.6b", "llama-3.2-1b"])
def test_the_lean_fp8_ring_fuses_with_the_separate_launches_bits(case_id):
    backend = fusing_backend()
    backend.row_variant = 5  # the two-head CTA's lean ring (decode_group_mma.cuh GroupFp8Cfg)
    case, rope = make_case(case_id, seed=3100 + list(CASES).index(case_id))
    check_fused(backend, case, rope)


@gpu
def test_fused_decode_with_forced_split_partitions_leaves_the_counters_zero(monkeypatch):
    from test_split_k_decode import counters_are_zero, force_partitions

    backend = fusing_backend()
    force_partitions(monkeypatch, backend, 64)
    rng = random.Random(77)
    seq_lens = [1, 64, 65, 2500] + [rng.randint(1, 2500) for _ in range(12)]
    case = Case(seq_lens, [1] * len(seq_lens), 16, 8, 128, 16, torch.bfloat16, pad_rows=2, fused_qkv=True, seed=77)
    check_fused(backend, case, rope_inputs(case, 77))
    assert counters_are_zero(backend), "a launch left a split-K counter nonzero"


@gpu
@pytest.mark.parametrize("rows", [6, 64], ids=["split", "one-partition"])
def test_fused_decode_graph_replays_match_eager_launches(rows):
    backend = fusing_backend()
    rng = random.Random(rows)
    case = Case([rng.randint(1, 3000) for _ in range(rows - 1)] + [1], [1] * rows, 16, 8, 128, 16, torch.bfloat16,
                fused_qkv=True, seed=rows)
    rope = rope_inputs(case, rows)
    cache = check_fused(backend, case, rope)
    args = (case.q, case.k, case.v, cache, case.md, case.scale, None, None, 0.5, 2.0, rope)
    graph, out = captured(lambda: backend.attend_rope(*args))
    gen = torch.Generator(device="cuda").manual_seed(rows)
    qkv = case.q.as_strided((case.q.shape[0], case.q.stride(0)), (case.q.stride(0), 1))  # the projection rows
    for _ in range(3):
        qkv.copy_(torch.randn(qkv.shape, generator=gen, device="cuda").to(qkv.dtype))
        graph.replay()
        replayed_cache = cache.clone()
        eager = backend.attend_rope(*args)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "a replay differs from an eager launch"
        assert torch.equal(replayed_cache.view(torch.uint8), cache.view(torch.uint8)), "a replay wrote other bytes"


def declined(backend, case: Case, rope: RopeInputs, cache: torch.Tensor | None = None, softcap: float | None = None):
    cache = fp8_cache(case, 1.0, 1.0) if cache is None else cache
    return backend.attend_rope(case.q, case.k, case.v, cache, case.md, case.scale, case.window, softcap, 1.0, 1.0,
                               rope) is None


@gpu
def test_steps_the_fused_launch_cannot_serve_are_declined():
    backend = fusing_backend()
    case, rope = make_case("qwen3-0.6b-split", seed=5)
    assert not declined(backend, case, rope)
    assert declined(backend, case, rope, cache=case.cache.clone()), "a bf16 cache (the row kernel serves it)"
    assert declined(backend, case, rope, softcap=30.0), "soft-capping"
    d = case.q.shape[2]
    partial = RopeInputs(rope.cos[..., :d // 2], rope.sin[..., :d // 2], rope.q_weight, rope.k_weight, 1e-6, None)
    assert declined(backend, case, partial), "partial rotary"
    backend.fuse_rope = False
    assert declined(backend, case, rope), "PAGEDNB_FUSE_ROPE=0"
    backend.fuse_rope = True
    chunk = Case([900, 40], [1, 7], 16, 8, 128, 16, torch.bfloat16, fused_qkv=True, seed=6)
    assert declined(backend, chunk, rope_inputs(chunk, 6)), "a prefill chunk in the step"
    two_heads = Case([300, 20], [1, 1], 16, 8, 128, 16, torch.bfloat16, seed=8)
    shifted = torch.empty(2 * 16 * 128 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(2, 16, 128)
    shifted.copy_(two_heads.q)
    two_heads.q = shifted  # 2 bytes off the 16-byte grid
    assert declined(backend, two_heads, rope_inputs(two_heads, 8)), "unaligned query rows"


def resident_wave(backend) -> int:
    """Resident decode CTAs of Qwen3-0.6B's heads over an fp8 cache on this GPU, counted per kv head."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bf16 = backend._dtype_codes[torch.bfloat16]
    return sms * backend._lib.pagednb_decode_resident_ctas(bf16, 128, 2, DEFAULT_ROW_VARIANT, 1)


def partitions_of(case: Case) -> int:
    return next(iter(case.md._cuda_plan.row_plans.values()))[0]


@gpu
def test_by_default_one_partition_launches_fuse_up_to_one_wave():
    """The policy (_fusion_pays, from the H200 probe in benchmarks/NOTES.md, issue 19's fifteenth round): a
    one-partition launch whose CTAs (one per row and kv head) fit one wave of resident CTAs fuses; more rows take
    the separate launches."""
    backend = cuda_backend(DEFAULT_ROW_VARIANT)
    wave = resident_wave(backend)
    rng = random.Random(11)
    for rows, fuses in ((wave // 8, True), (wave // 8 + 1, False), (256, wave >= 256 * 8)):
        case = Case([rng.randint(300, 2000) for _ in range(rows)], [1] * rows, 16, 8, 128, 16, torch.bfloat16,
                    fused_qkv=True, seed=rows)
        assert declined(backend, case, rope_inputs(case, rows)) != fuses, f"{rows} rows"
        assert partitions_of(case) == 1, "a one-partition launch"


@gpu
def test_by_default_split_launches_fuse_near_one_wave_and_batch_one_does_not():
    """Split-K launches fuse where their CTAs (rows x kv heads x partitions) come to half a wave to 1.5 waves (the
    sixteenth round's policy: the probe's 4-48 rows gained 2-9% a layer); a batch-1 launch, a tenth of a wave,
    keeps the separate launches (it lost 4% fused)."""
    backend = cuda_backend(DEFAULT_ROW_VARIANT)
    wave = resident_wave(backend)
    lo, hi = DEFAULT_FUSE_ROPE_SPLIT_WAVES
    rng = random.Random(13)
    seen = {}
    for rows in (1, 2, 4, 8, 16, 32):
        case = Case([2000] + [rng.randint(500, 2000) for _ in range(rows - 1)], [1] * rows, 16, 8, 128, 16,
                    torch.bfloat16, fused_qkv=True, seed=rows)
        fused = not declined(backend, case, rope_inputs(case, rows))
        parts = partitions_of(case)
        if parts == 1:
            continue
        seen[rows] = fused
        assert fused == (lo * wave <= rows * 8 * parts <= hi * wave), f"{rows} rows in {parts} partitions"
    assert seen.get(1) is False, "batch 1 splits and stays unfused"
    assert any(seen.values()), f"no split launch fused: {seen}"
    split, rope = make_case("qwen3-0.6b-split", seed=12)
    backend.fuse_rope_split = None
    assert declined(backend, split, rope), "PAGEDNB_FUSE_ROPE_SPLIT=0"
    backend.fuse_rope_split = (0.0, float("inf"))
    assert not declined(backend, split, rope)


def test_backends_without_a_fused_launch_decline_it():
    """The reference backend (and any backend that does not override attend_rope) returns None: the model then
    runs the norm, the rotary embedding and the cache write itself."""
    q = torch.zeros(1, 2, 16)
    rope = RopeInputs(torch.ones(1, 16), torch.zeros(1, 16), None, None, 1e-6, None)
    assert TorchReferenceBackend().attend_rope(q, q[:, :1], q[:, :1], torch.zeros(2, 1, 16, 1, 16), None, 0.25,
                                               None, None, 1.0, 1.0, rope) is None


# ---- end to end -------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("arch, overrides", [
    ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128)),
    ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64)),
], ids=["qwen3-head_dim-128", "llama-head_dim-64"])
def test_an_fp8_engine_gives_the_same_tokens_and_logprobs_with_and_without_the_fusion(tiny_model_dir, monkeypatch,
                                                                                     arch, overrides):
    path = str(tiny_model_dir(arch, **overrides))
    fused_steps = []
    real = CudaPagedBackend.attend_rope

    def counted(self, *args):
        out = real(self, *args)
        fused_steps.append(out is not None)
        return out

    monkeypatch.setattr(CudaPagedBackend, "attend_rope", counted)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    prompts = ["The dog", "A cat sat on the mat and", "x", "Once upon a time there was"]
    outs = {}
    for fuse in ("1", "0"):
        monkeypatch.setenv("PAGEDNB_FUSE_ROPE", fuse)
        fused_steps.clear()
        with LLM(path, dtype="bfloat16", kv_cache_dtype="fp8", num_kv_blocks=256) as llm:
            assert llm.engine.attention_backend.fuse_rope == (fuse == "1")
            outs[fuse] = llm.generate(prompts, greedy, use_tqdm=False)
        assert any(fused_steps) == (fuse == "1"), "the fused launch ran where it should not, or never"
    for a, b in zip(outs["1"], outs["0"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in a.outputs[0].logprobs] == \
            [{t: lp.logprob for t, lp in step.items()} for step in b.outputs[0].logprobs]


@pytest.mark.parametrize("raw, band", [("0", None), ("1", (0.0, float("inf"))), ("0.25,2", (0.25, 2.0)),
                                       ("", DEFAULT_FUSE_ROPE_SPLIT_WAVES)])
def test_the_split_knob_reads_never_always_or_a_band(monkeypatch, raw, band):
    from pagednb.attention.cuda_backend import _split_band_from_env
    monkeypatch.setenv("PAGEDNB_FUSE_ROPE_SPLIT", raw)
    assert _split_band_from_env() == band


@pytest.mark.parametrize("raw", ["x", "2,1", "-1,1", "1,2,3", "nan,1"])
def test_the_split_knob_is_checked_naming_the_variable(monkeypatch, raw):
    from pagednb.attention.cuda_backend import _split_band_from_env
    monkeypatch.setenv("PAGEDNB_FUSE_ROPE_SPLIT", raw)
    with pytest.raises(ValueError, match="PAGEDNB_FUSE_ROPE_SPLIT"):
        _split_band_from_env()


@pytest.mark.parametrize("raw", ["x", "-1", "nan"])
def test_the_waves_knob_is_checked_naming_the_variable(monkeypatch, raw):
    from pagednb.attention.cuda_backend import DEFAULT_FUSE_ROPE_WAVES, _waves_from_env
    monkeypatch.setenv("PAGEDNB_FUSE_ROPE_WAVES", raw)
    with pytest.raises(ValueError, match="PAGEDNB_FUSE_ROPE_WAVES"):
        _waves_from_env()
    monkeypatch.setenv("PAGEDNB_FUSE_ROPE_WAVES", "2.5")
    assert _waves_from_env() == 2.5
    monkeypatch.delenv("PAGEDNB_FUSE_ROPE_WAVES")
    assert _waves_from_env() == DEFAULT_FUSE_ROPE_WAVES
