"""The fused elementwise ops of the decoder (pagednb/model/fused_ops.py, kernels_cuda/fused_ops.cu).

Each op has a reference, the plain torch code with HF transformers' rounding points; on CPU (always
run) it is checked against the formulas written out below, one rounding to the model dtype after
every elementwise step. On a GPU (the H200 device; skipped elsewhere) the kernels reproduce it:

  * bit for bit in bf16, fp16 and fp32 wherever no sum is involved (SiLU * mul, GELU-tanh * mul, the
    rotary embedding)
    and for the norms when every float32 sum of squares is exact: inputs k/8 with small integers k,
    so every partial sum is a multiple of 1/64 below 2^17 and the summation order cannot matter;
  * on random inputs a norm adds its float32 squares in another order than torch, so its mean of
    squares can differ in the last bit; the normalised value x * rsqrt(mean + eps) can then round to
    the neighbouring value of the dtype, 1 ulp, which the multiply by the weight (a mantissa in [1, 2))
    can widen to 2 ulp of the output. Tolerance for bf16/fp16: at most 2 ulp, and at most 1% of the
    elements differ at all (a wrong rounding point changes far more than that). After the rotary
    embedding, where sums of two products may cancel, the bound is 8 ulp at the head's largest
    magnitude. fp32: within 1e-6 relative (of the head's largest magnitude after the rotary embedding).

Then: the kernels captured in a CUDA graph and replayed on new inputs give the eager results, inputs the
kernels do not cover take the reference, and the engine's greedy outputs are the same with and without
the fused ops.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from gpu_support import built_kernels, captured, gpu

from pagednb.model import fused_ops
from pagednb.model.fused_ops import (GELU_TANH, SILU, gelu_tanh_and_mul_reference, qk_norm_rope_reference,
                                     rms_norm_reference, silu_and_mul_reference)
from pagednb.model.layers import RMSNorm
from pagednb.model.rotary import RotaryEmbedding

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]
EPS = 1e-6


# ---- inputs --------------------------------------------------------------------------------------------
def small_ints(*shape: int, gen: torch.Generator, device="cpu", limit: int = 16) -> torch.Tensor:
    """k / 8 for integers |k| <= limit: exact in every dtype, and so are their squares' float32 sums."""
    return torch.randint(-limit, limit + 1, shape, generator=gen).float().div(8).to(device)


def rope_tables(n: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator, device="cpu"):
    """cos, sin [n, 1, D] as RotaryEmbedding gives them, for n distinct unsorted positions."""
    rope = RotaryEmbedding(SimpleNamespace(max_position_embeddings=4096, rope_theta=1e6), head_dim).to(device)
    positions = torch.randperm(4096, generator=gen)[:n].to(device)
    return rope(positions, dtype)


def fused_qkv(n: int, heads: int, kv_heads: int, d: int, qkv: torch.Tensor):
    """q [n, H, D] and k [n, Hkv, D]: strided views of a fused qkv projection output [n, (H + 2Hkv) D]."""
    q = qkv[:, :heads * d].view(n, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(n, kv_heads, d)
    return q, k


# ---- the formulas, one rounding to the model dtype per elementwise step ---------------------------------
def rnd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).float()


def norm_formula(x, w, dtype):
    h = x.float()
    mean_sq = (h * h).mean(-1, keepdim=True)
    return rnd(w.float() * rnd(h * torch.rsqrt(mean_sq + EPS), dtype), dtype)


def rope_formula(x, cos, sin, dtype):
    x = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return rnd(rnd(x * cos.float(), dtype) + rnd(rot * sin.float(), dtype), dtype)


# ---- CPU: the references are the formulas ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_reference_rounds_where_hf_rounds(dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    r = torch.randn(7, 96, generator=gen).to(dtype) if with_residual else None
    s = rnd(x.float() + r.float(), dtype) if with_residual else x.float()  # the add, in the model dtype

    result = rms_norm_reference(x, w, EPS, r)
    out, new_residual = result if with_residual else (result, None)
    assert out.dtype == dtype and torch.equal(out.float(), norm_formula(s, w, dtype))
    if with_residual:
        assert torch.equal(new_residual.float(), s)


def test_rms_norm_module_on_cpu_is_the_reference_and_leaves_its_inputs_alone():
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(64, EPS).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    r = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    x0, r0 = x.clone(), r.clone()
    with torch.inference_mode():
        out, new_residual = norm(x, r)
        alone = norm(x)
    ref_out, ref_residual = rms_norm_reference(x0, norm.weight, EPS, r0)
    assert torch.equal(out, ref_out) and torch.equal(new_residual, ref_residual)
    assert torch.equal(alone, rms_norm_reference(x0, norm.weight, EPS))
    assert torch.equal(x, x0) and torch.equal(r, r0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm+rope"])
def test_qk_norm_rope_reference_on_strided_views(dtype, qk_norm):
    gen = torch.Generator().manual_seed(2)
    n, heads, kv_heads, d = 7, 4, 2, 32
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    before = qkv.clone()
    q, k = fused_qkv(n, heads, kv_heads, d, qkv)
    cos, sin = rope_tables(n, d, dtype, gen)
    qw, kw = (torch.randn(d, generator=gen).to(dtype), torch.randn(d, generator=gen).to(dtype)) if qk_norm \
        else (None, None)

    out_q, out_k = qk_norm_rope_reference(q, k, cos, sin, qw, kw, EPS)
    for out, x, w in ((out_q, q, qw), (out_k, k, kw)):
        x = norm_formula(x, w, dtype) if qk_norm else x.float()
        assert out.dtype == dtype and torch.equal(out.float(), rope_formula(x, cos, sin, dtype))
    assert torch.equal(qkv, before)  # the reference writes new tensors


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(7, 2 * 48, generator=gen) * 4).to(dtype)
    gate, up = gate_up[:, :48].float(), gate_up[:, 48:].float()
    expected = rnd(rnd(F.silu(gate), dtype) * up, dtype)  # silu in float32, rounded; the product rounded
    out = silu_and_mul_reference(gate_up)
    assert out.shape == (7, 48) and torch.equal(out.float(), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gelu_tanh_and_mul_reference_rounds_where_hf_rounds(dtype):
    """HF's gelu_pytorch_tanh runs torch's gelu in the model dtype: computed in float32, rounded, then the
    product with up rounded again (not one rounding of the float32 product)."""
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(7, 2 * 48, generator=gen) * 4).to(dtype)
    gate, up = gate_up[:, :48].float(), gate_up[:, 48:].float()
    expected = rnd(rnd(F.gelu(gate, approximate="tanh"), dtype) * up, dtype)
    out = gelu_tanh_and_mul_reference(gate_up)
    assert out.shape == (7, 48) and out.dtype == dtype
    # torch's CPU gelu on a strided view (gate) and on a dense tensor differ in the saturated tail only
    differ = out.float() != expected
    assert (expected[differ].abs() < 1e-5).all() and differ.float().mean() < 0.05
    tanh_formula = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3)))
    torch.testing.assert_close(rnd(F.gelu(gate, approximate="tanh"), dtype), rnd(tanh_formula, dtype),
                               rtol=torch.finfo(dtype).eps, atol=1e-6)  # the tanh form, not erf's


def test_cpu_tensors_never_reach_the_kernel_library(monkeypatch):
    def unreachable():
        raise AssertionError("a CPU op looked up the CUDA kernels")

    monkeypatch.setattr(fused_ops.KERNELS, "enabled", unreachable)
    gen = torch.Generator().manual_seed(4)
    x, r, w = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen), torch.randn(64, generator=gen)
    for got, want in zip(fused_ops.rms_norm(x, w, EPS, r), rms_norm_reference(x, w, EPS, r)):
        assert torch.equal(got, want)
    q, k = fused_qkv(3, 4, 2, 16, torch.randn(3, 8 * 16, generator=gen))
    cos, sin = rope_tables(3, 16, torch.float32, gen)
    qw, kw = w[:16], w[16:32]
    for got, want in zip(fused_ops.qk_norm_rope(q, k, cos, sin, qw, kw, EPS),
                         qk_norm_rope_reference(q, k, cos, sin, qw, kw, EPS)):
        assert torch.equal(got, want)
    assert torch.equal(fused_ops.gate_and_mul(x, SILU), silu_and_mul_reference(x))
    assert torch.equal(fused_ops.gate_and_mul(x, GELU_TANH), gelu_tanh_and_mul_reference(x))


def test_pagednb_fused_ops_0_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv("PAGEDNB_FUSED_OPS", "0")
    fused_ops.KERNELS.enabled.cache_clear()
    try:
        assert fused_ops.KERNELS.enabled() is None  # and the library is not even looked up
    finally:
        fused_ops.KERNELS.enabled.cache_clear()


# ---- GPU: the kernels against the references -------------------------------------------------------------
@pytest.fixture(scope="module")
def kernels():
    return built_kernels(fused_ops.KERNELS.get)


def ulps(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in units in the last place of ref's dtype at ref's magnitude."""
    precision, min_exp = {torch.bfloat16: (8, -126), torch.float16: (11, -14), torch.float32: (24, -126)}[ref.dtype]
    _, exp = torch.frexp(ref.float())  # |ref| in [2^(exp-1), 2^exp): ulp = 2^(exp - precision)
    ulp = torch.pow(2.0, (exp.clamp(min=min_exp + 1) - precision).float())
    return (out.float() - ref.float()).abs() / ulp


def assert_norm_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
        return
    u = ulps(out, ref)
    assert u.max().item() <= 2, f"max {u.max().item()} ulp"
    assert (u > 0).float().mean().item() <= 0.01, f"{(u > 0).float().mean().item():.2%} of the elements differ"


def assert_rope_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    scale = ref.float().abs().amax(dim=-1, keepdim=True)  # the head's largest magnitude
    diff = (out.float() - ref.float()).abs()
    bound = 1e-6 if out.dtype == torch.float32 else 8 * torch.finfo(out.dtype).eps
    assert (diff <= bound * scale).all(), f"max {(diff / scale).max().item():.3g} of the head's scale"
    if out.dtype != torch.float32:
        assert (diff > 0).float().mean().item() <= 0.01


RMS_HIDDEN = [64, 136, 1024, 2048, 3072, 8192]
ROWS = [1, 7, 256]


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", RMS_HIDDEN)
def test_rms_norm_is_bit_exact_when_the_sums_are(kernels, dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    w = torch.randn(hidden, generator=gen).to("cuda", dtype)
    for n in ROWS:
        for with_residual in (False, True):
            case = f"n={n} residual={with_residual}"
            x = small_ints(n, hidden, gen=gen, device="cuda").to(dtype)
            r = small_ints(n, hidden, gen=gen, device="cuda").to(dtype) if with_residual else None
            x0, r0 = x.clone(), None if r is None else r.clone()
            got = kernels.rms_norm(x, w, EPS, r)
            assert got is not None, f"the kernel declined {case}"
            ref = rms_norm_reference(x, w, EPS, r)
            if with_residual:
                assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), case
                assert torch.equal(r, r0), case  # the new residual is a new tensor
            else:
                assert torch.equal(got, ref), case
            assert torch.equal(x, x0), case


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [64, 1024, 2048, 3072])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_on_random_inputs(kernels, dtype, hidden, with_residual):
    gen = torch.Generator().manual_seed(hidden)
    n = 256
    x = (torch.randn(n, hidden, generator=gen) * 4).to("cuda", dtype)
    r = (torch.randn(n, hidden, generator=gen) * 4).to("cuda", dtype) if with_residual else None
    w = torch.randn(hidden, generator=gen).to("cuda", dtype)
    got = kernels.rms_norm(x, w, EPS, r)
    assert got is not None
    ref = rms_norm_reference(x, w, EPS, r)
    if with_residual:
        assert torch.equal(got[1], ref[1])  # the add has no sum: exact
        got, ref = got[0], ref[0]
    assert_norm_close(got, ref)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_reads_rows_with_a_stride(kernels, dtype):
    gen = torch.Generator().manual_seed(5)
    buf = small_ints(7, 2048 + 64, gen=gen, device="cuda").to(dtype)
    x = buf[:, 32:32 + 2048]  # rows 2112 elements apart, 16-byte aligned
    r = small_ints(7, 2048, gen=gen, device="cuda").to(dtype)
    w = torch.randn(2048, generator=gen).to("cuda", dtype)
    got = kernels.rms_norm(x, w, EPS, r)
    assert got is not None
    ref = rms_norm_reference(x, w, EPS, r)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["olmo2", "gemma"])
def test_rms_norm_with_the_weight_in_float32_is_bit_exact_when_the_sums_are(kernels, dtype, offset):
    """OLMo 2's (w * h) and Gemma's (h * (1 + w)) norms: the weight applied in float32, one rounding."""
    gen = torch.Generator().manual_seed(int(offset) + 7)
    for hidden in (64, 136, 1152, 2048):  # 1152: Gemma-3-1B
        w = (torch.randn(hidden, generator=gen) * 0.5).to("cuda", dtype)
        for with_residual in (False, True):
            x = small_ints(7, hidden, gen=gen, device="cuda").to(dtype)
            r = small_ints(7, hidden, gen=gen, device="cuda").to(dtype) if with_residual else None
            got = kernels.rms_norm(x, w, EPS, r, offset)
            assert got is not None, "the kernel declined"
            ref = rms_norm_reference(x, w, EPS, r, offset)
            got, ref = (got, ref) if with_residual else ((got,), (ref,))
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), f"hidden={hidden} residual={with_residual}"
            if offset:  # really (1 + w), not Llama's w
                assert not torch.equal(got[0], rms_norm_reference(x, w, EPS, r)[0] if with_residual
                                       else rms_norm_reference(x, w, EPS))


HEAD_DIMS = [16, 32, 64, 128, 256]
HEADS = [(16, 8), (32, 8), (4, 2)]


def _qk_case(n, heads, kv_heads, d, dtype, qk_norm, exact, seed):
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * d
    qkv = (small_ints(n, width, gen=gen) if exact else torch.randn(n, width, generator=gen) * 3).to("cuda", dtype)
    cos, sin = rope_tables(n, d, dtype, gen, device="cuda")
    weights = (torch.randn(d, generator=gen).to("cuda", dtype), torch.randn(d, generator=gen).to("cuda", dtype)) \
        if qk_norm else (None, None)
    return qkv, cos, sin, weights


def _run_qk(kernels, n, heads, kv_heads, d, qkv, cos, sin, weights):
    q, k = fused_qkv(n, heads, kv_heads, d, qkv)
    ref_q, ref_k = qk_norm_rope_reference(q.clone(), k.clone(), cos, sin, *weights, EPS)
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    got = kernels.qk_norm_rope(q, k, cos, sin, *weights, EPS)
    assert got is not None, "the kernel declined these inputs"
    assert got[0].data_ptr() == q.data_ptr() and got[1].data_ptr() == k.data_ptr()  # in place
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)  # v untouched
    return got, (ref_q, ref_k)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", [128, 256])
def test_qk_norm_rope_with_gemma_norm_weights_is_bit_exact_when_the_sums_are(kernels, dtype, d):
    """Gemma 3's per-head q/k norms, (1 + w) in float32, in the same launch as the rotary embedding."""
    for n in ROWS:
        qkv, cos, sin, weights = _qk_case(n, 8, 4, d, dtype, True, exact=True, seed=d + n)
        q, k = fused_qkv(n, 8, 4, d, qkv)
        ref_q, ref_k = qk_norm_rope_reference(q.clone(), k.clone(), cos, sin, *weights, EPS, 1.0)
        llama_q, _ = qk_norm_rope_reference(q.clone(), k.clone(), cos, sin, *weights, EPS)
        got = kernels.qk_norm_rope(q, k, cos, sin, *weights, EPS, 1.0)
        assert got is not None, "the kernel declined these inputs"
        assert torch.equal(got[0], ref_q) and torch.equal(got[1], ref_k), f"n={n}"
        assert not torch.equal(got[0], llama_q)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm+rope"])
def test_qk_norm_rope_is_bit_exact_when_the_sums_are(kernels, dtype, d, qk_norm):
    for heads, kv_heads in HEADS:
        for n in ROWS:
            qkv, cos, sin, weights = _qk_case(n, heads, kv_heads, d, dtype, qk_norm, exact=True, seed=d + n + heads)
            (q, k), (ref_q, ref_k) = _run_qk(kernels, n, heads, kv_heads, d, qkv, cos, sin, weights)
            assert torch.equal(q, ref_q) and torch.equal(k, ref_k), f"H={heads} Hkv={kv_heads} n={n}"


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_rope_alone_is_bit_exact_on_random_inputs(kernels, dtype, d):
    for heads, kv_heads in HEADS:
        qkv, cos, sin, weights = _qk_case(256, heads, kv_heads, d, dtype, False, exact=False, seed=d + heads)
        (q, k), (ref_q, ref_k) = _run_qk(kernels, 256, heads, kv_heads, d, qkv, cos, sin, weights)
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k), f"H={heads} Hkv={kv_heads}"


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_qk_norm_rope_on_random_inputs(kernels, dtype, d):
    qkv, cos, sin, weights = _qk_case(256, 32, 8, d, dtype, True, exact=False, seed=d)
    (q, k), (ref_q, ref_k) = _run_qk(kernels, 256, 32, 8, d, qkv, cos, sin, weights)
    assert_rope_close(q, ref_q)
    assert_rope_close(k, ref_k)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm+rope"])
def test_the_cache_write_in_the_same_launch_equals_the_backends_cache_write(kernels, dtype, d, qk_norm):
    """qk_norm_rope_write_kv: the q and k of qk_norm_rope and the cache of the backend's write_kv, bit for bit;
    slot -1 rows (graph padding) and every other slot left as they were."""
    from pagednb.attention.torch_ref import TorchReferenceBackend

    heads, kv_heads, n, block_size, blocks = 16, 4, 37, 16, 12
    qkv, cos, sin, weights = _qk_case(n, heads, kv_heads, d, dtype, qk_norm, exact=False, seed=d + 99)
    gen = torch.Generator().manual_seed(d)
    cache = torch.randn(2, blocks, block_size, kv_heads, d, generator=gen).to("cuda", dtype)
    slots = torch.randperm(blocks * block_size, generator=gen)[:n].to("cuda")
    slots[[3, 17, 36]] = -1
    want_cache = cache.clone()
    q_ref, k_ref = fused_ops.qk_norm_rope(*fused_qkv(n, heads, kv_heads, d, qkv.clone()), cos, sin, *weights, EPS)
    v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
    TorchReferenceBackend().write_kv(k_ref, v, want_cache, slots)

    q, k = fused_qkv(n, heads, kv_heads, d, qkv)
    got = fused_ops.qk_norm_rope_write_kv(q, k, v, cos, sin, *weights, EPS, cache, slots)
    assert got is not None, "the kernel declined these inputs"
    assert torch.equal(got[0], q_ref) and torch.equal(got[1], k_ref)
    assert torch.equal(cache, want_cache)


GATED = [(SILU, silu_and_mul_reference), (GELU_TANH, gelu_tanh_and_mul_reference)]


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("inter", [64, 1024, 3072, 6912, 8960])  # 6912: Gemma-3-1B
@pytest.mark.parametrize("gate, reference", GATED, ids=["silu", "gelu_tanh"])
def test_gated_activations_are_bit_exact(kernels, dtype, inter, gate, reference):
    gen = torch.Generator().manual_seed(inter)
    for n in ROWS:
        gate_up = (torch.randn(n, 2 * inter, generator=gen) * 4).to("cuda", dtype)
        got = kernels.gate_and_mul(gate_up, gate)
        assert got is not None and got.shape == (n, inter) and got.is_contiguous()
        want = reference(gate_up)
        differ = got != want
        assert not differ.any(), (f"n={n}: {differ.sum().item()} of {differ.numel()} differ, max "
                                  f"{ulps(got, want).max().item()} ulp")


@gpu
def test_gated_activations_read_rows_with_a_stride(kernels):
    gen = torch.Generator().manual_seed(6)
    buf = (torch.randn(7, 2 * 1024 + 64, generator=gen) * 4).to("cuda", torch.bfloat16)
    gate_up = buf[:, :2 * 1024]
    for gate, reference in GATED:
        got = kernels.gate_and_mul(gate_up, gate)
        assert got is not None and torch.equal(got, reference(gate_up))


@gpu
def test_inputs_the_kernels_do_not_cover_take_the_reference(kernels):
    gen = torch.Generator().manual_seed(7)
    flat = torch.randn(7 * 64 + 1, generator=gen).to("cuda", torch.bfloat16)
    x = flat[1:].view(7, 64)  # 2 bytes past a 16-byte boundary
    w = torch.randn(64, generator=gen).to("cuda", torch.bfloat16)
    assert kernels.rms_norm(x, w, EPS) is None
    assert kernels.gate_and_mul(x, SILU) is None and kernels.gate_and_mul(x, GELU_TANH) is None
    assert torch.equal(fused_ops.rms_norm(x, w, EPS), rms_norm_reference(x, w, EPS))
    assert torch.equal(fused_ops.gate_and_mul(x, SILU), silu_and_mul_reference(x))
    assert torch.equal(fused_ops.gate_and_mul(x, GELU_TANH), gelu_tanh_and_mul_reference(x))
    # fp32 weights with bf16 activations (torch would promote): not the kernels' job
    assert kernels.rms_norm(flat[:7 * 64].view(7, 64), w.float(), EPS) is None
    # head_dim 48 is not a kernel instance
    qkv = torch.randn(3, 8 * 48, generator=gen).to("cuda", torch.bfloat16)
    q, k = fused_qkv(3, 4, 2, 48, qkv)
    cos, sin = rope_tables(3, 48, torch.bfloat16, gen, device="cuda")
    assert kernels.qk_norm_rope(q, k, cos, sin, None, None, EPS) is None
    # autograd: the kernels have no backward
    xg = torch.randn(7, 64, generator=gen).to("cuda").requires_grad_()
    assert fused_ops.rms_norm(xg, w.float(), EPS).grad_fn is not None


@gpu
def test_kernels_capture_in_a_cuda_graph_and_replay_on_new_inputs(kernels):
    gen = torch.Generator().manual_seed(8)
    dtype, n, hidden, inter, heads, kv_heads, d = torch.bfloat16, 8, 2048, 3072, 16, 8, 128

    def fresh():
        return dict(x=torch.randn(n, hidden, generator=gen), r=torch.randn(n, hidden, generator=gen),
                    qkv=torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen),
                    gate_up=torch.randn(n, 2 * inter, generator=gen) * 4,
                    positions=torch.randperm(4096, generator=gen)[:n])

    rope = RotaryEmbedding(SimpleNamespace(max_position_embeddings=4096, rope_theta=1e6), d).to("cuda")
    w = torch.randn(hidden, generator=gen).to("cuda", dtype)
    qw, kw = (torch.randn(d, generator=gen).to("cuda", dtype) for _ in range(2))
    static = {k: v.to("cuda", dtype) if v.is_floating_point() else v.to("cuda") for k, v in fresh().items()}

    def step(t):
        out, new_residual = kernels.rms_norm(t["x"], w, EPS, t["r"])
        cos, sin = rope(t["positions"], dtype)
        q, k = fused_qkv(n, heads, kv_heads, d, t["qkv"])
        assert kernels.qk_norm_rope(q, k, cos, sin, qw, kw, EPS) is not None
        act = kernels.gate_and_mul(t["gate_up"], SILU)
        gelu = kernels.gate_and_mul(t["gate_up"], GELU_TANH)
        assert act is not None and gelu is not None
        return out, new_residual, t["qkv"], act, gelu

    graph, outputs = captured(lambda: step(static), warm_up=lambda: step({k: v.clone() for k, v in static.items()}))

    for _ in range(2):
        new = fresh()
        for key, value in new.items():
            static[key].copy_(value.to(static[key].dtype))
        eager = step({k: v.clone() for k, v in static.items()})
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outputs, eager):
            assert torch.equal(got, want)


@gpu
def test_engine_greedy_outputs_are_the_same_with_and_without_the_fused_ops(tiny_model_dir, monkeypatch):
    """Qwen3 (q/k norm) in float32, decode steps in CUDA graphs: token for token the same either way."""
    from pagednb import LLM, SamplingParams

    path = tiny_model_dir("qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    prompts = ["Once upon a time there was a cat", "The dog", "Paged attention stores the key value cache " * 3]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run():
        with LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    fused = run()
    monkeypatch.setattr(fused_ops.KERNELS, "enabled", lambda: None)
    assert run() == fused
