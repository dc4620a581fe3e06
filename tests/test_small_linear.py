"""Linear layers of small decode steps (pagednb/model/small_linear.py, kernels_cuda/gemv.cu).

`linear` is F.linear's contract. On CPU (always run) it is F.linear, and every projection of the decoder
goes through it. On a GPU (the H200 device; skipped elsewhere), for bf16/fp16 inputs of one row (two for
weights of fewer than 4,096 rows), where benchmarks/linear.py measured the kernel faster than cuBLAS:

  * each output is within one rounding of the exact (float64) product, plus the float32 accumulation
    error bound (K - 1) * 2^-24 * sum |x w|;
  * a row's output is bit for bit the same alone, beside another row, and in a CUDA graph replay: the
    order of its float32 sums depends only on the weight's shape;
  * strided rows and leading dimensions are served; inputs the kernel does not serve (3 rows, 2 rows of
    a wide weight, float32, misaligned rows, K % 8 != 0) are exactly F.linear;
  * `linear_gate_and_mul` with SILU or GELU_TANH (a gated MLP's gate/up projection, the GEMV applying
    SiLU(gate) * up or GELU-tanh(gate) * up to its own outputs) give the bits of the GEMV followed by the
    activation kernel, wide and narrow weights, with a plain or a normed input, in and out of a CUDA graph,
    and are the activation of linear(...) wherever the GEMV does not serve (CPU, 3 rows);
  * a `NormedInput` (RMSNorm(hidden + residual), a block's first projection) gives the bits of the RMSNorm
    kernel followed by the GEMV (its sum of squares added in that kernel's order) at hidden 512 to 8192,
    for Llama's, OLMo 2's and Gemma's norm weights, with and without a residual; its `stream` is hidden +
    residual exactly; 3 rows and CPU tensors run the norm first.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_support import built_kernels, captured, gpu

from pagednb.model import small_linear
from pagednb.model.fused_ops import (GATES, gate_and_mul, gelu_tanh_and_mul_reference, rms_norm, rms_norm_reference,
                                     silu_and_mul_reference)
from pagednb.model.small_linear import Linear, NormedInput, gemv_serves, linear, linear_gate_and_mul

REFERENCES = {"silu": silu_and_mul_reference, "gelu_tanh": gelu_tanh_and_mul_reference}

MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11}


# ---- CPU: the contract and the wiring -----------------------------------------------------------------
def test_linear_is_f_linear_on_cpu():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 5, 64, generator=gen), torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("activation", list(GATES))
def test_a_gated_projection_is_the_projection_then_the_activation_on_cpu(activation):
    gate, reference = GATES[activation], REFERENCES[activation]
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 64, generator=gen), torch.randn(80, 64, generator=gen), torch.randn(80, generator=gen)
    assert torch.equal(linear_gate_and_mul(x, w, b, gate), reference(F.linear(x, w, b)))
    normed = NormedInput(x, x.flip(0), torch.randn(64, generator=gen), 1e-6, None)
    expected = reference(F.linear(rms_norm_reference(x + x.flip(0), normed.weight, 1e-6), w, b))
    assert torch.equal(linear_gate_and_mul(normed, w, b, gate), expected)


@pytest.mark.parametrize("residual", [False, True], ids=["no-residual", "residual"])
def test_a_normed_input_is_the_norm_then_the_projection_on_cpu(residual):
    gen = torch.Generator().manual_seed(1)
    h, r = torch.randn(2, 3, 64, generator=gen), torch.randn(2, 3, 64, generator=gen)
    norm_w, w = torch.randn(64, generator=gen), torch.randn(40, 64, generator=gen)
    x = NormedInput(h, r if residual else None, norm_w, 1e-6, None)
    out = Linear(64, 40, bias=False).requires_grad_(False)
    out.weight.copy_(w)
    stream = h + r if residual else h
    assert torch.equal(out(x), F.linear(rms_norm_reference(stream, norm_w, 1e-6), w))
    assert torch.equal(x.stream, stream)


def test_linear_module_keeps_nn_linear_parameters_and_names():
    layer = Linear(64, 40, bias=True)
    assert isinstance(layer, torch.nn.Linear)
    assert set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(2, 64)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_every_projection_of_the_decoder_goes_through_small_linear(tiny_model_dir):
    from transformers import AutoConfig

    from pagednb.attention.torch_ref import TorchReferenceBackend
    from pagednb.model.registry import build_model, model_spec

    for arch in ("llama", "qwen3"):
        cfg = AutoConfig.from_pretrained(tiny_model_dir(arch))
        model = build_model(model_spec(cfg), cfg, TorchReferenceBackend())
        linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        assert linears, arch
        assert all(isinstance(model.get_submodule(name), Linear) for name in linears), linears


# ---- GPU: the kernel ---------------------------------------------------------------------------------------
def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int, bias: bool = False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype) if bias else None
    return x, w, b


def _assert_within_one_rounding(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    k = x.shape[-1]
    accumulation = (k - 1) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - (MANTISSA_BITS[out.dtype] - 1))
    err = (out.double() - exact).abs()
    bad = err > ulp + accumulation
    assert not bad.any(), f"{int(bad.sum())} outputs beyond one rounding, worst {(err / ulp).max().item():.2f} ulp"


@pytest.fixture(scope="module")
def kernel():
    return built_kernels(small_linear.KERNEL.get)


def test_the_kernel_serves_one_row_and_two_rows_of_narrow_weights_only():
    assert gemv_serves(1, 151936) and gemv_serves(1, 8)
    assert gemv_serves(2, 1024) and gemv_serves(2, 4095) and not gemv_serves(2, 4096)
    assert not any(gemv_serves(m, 1024) for m in range(3, 17))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (1000, 1032), (37, 64), (3, 8), (151936, 1024)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_outputs_are_within_one_rounding_of_the_exact_product(kernel, dtype, n, k, bias):
    for m in range(1, kernel.max_rows + 1):
        x, w, b = _inputs(m, n, k, dtype, seed=m, bias=bias)
        out = kernel.gemv(x, w, b)  # the kernel itself, also for shapes linear() leaves to cuBLAS
        assert out is not None and out.shape == (m, n) and out.dtype == dtype
        _assert_within_one_rounding(out, x, w, b)
        if gemv_serves(m, n):
            assert torch.equal(linear(x, w, b), out)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", [3000, 8192], ids=["narrow", "wide"])
def test_a_row_gives_the_same_bits_alone_and_beside_another(kernel, dtype, n):
    x, w, b = _inputs(2, n, 2048, dtype, seed=1, bias=True)
    pair = kernel.gemv(x, w, b)
    assert torch.equal(kernel.gemv(x[:1], w, b), pair[:1])
    assert torch.equal(kernel.gemv(x[1:], w, b), pair[1:])
    assert torch.equal(kernel.gemv(x.flip(0), w, b), pair.flip(0))


@gpu
def test_strided_rows_and_leading_dims(kernel):
    x, w, _ = _inputs(2, 512, 1024, torch.bfloat16, seed=2)
    wide = torch.zeros(2, 1024 + 64, device="cuda", dtype=torch.bfloat16)
    wide[:, 32:32 + 1024] = x
    view = wide[:, 32:32 + 1024]  # row stride 1088, 64-byte offset: still 16-byte aligned
    expected = linear(x, w)
    assert torch.equal(linear(view, w), expected)
    assert torch.equal(linear(x.view(2, 1, 1024), w), expected.view(2, 1, 512))


@gpu
def test_inputs_the_kernel_does_not_serve_are_exactly_f_linear(kernel):
    x, w, b = _inputs(3, 256, 512, torch.bfloat16, seed=3, bias=True)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))  # 3 rows: cuBLAS
    x2, w_wide, _ = _inputs(2, 4096, 512, torch.bfloat16, seed=6)
    assert torch.equal(linear(x2, w_wide), F.linear(x2, w_wide))  # 2 rows of a wide weight: cuBLAS
    assert torch.equal(linear(x.float()[:1], w.float(), b.float()), F.linear(x.float()[:1], w.float(), b.float()))
    buf = torch.zeros(512 + 1, device="cuda", dtype=torch.bfloat16)
    misaligned = buf[1:].view(1, 512)  # 2 bytes off a 16-byte boundary
    misaligned.copy_(x[:1])
    assert torch.equal(linear(misaligned, w, b), F.linear(misaligned, w, b))
    w_odd = torch.randn(16, 12, device="cuda").to(torch.bfloat16)  # K % 8 != 0
    x_odd = torch.randn(1, 12, device="cuda").to(torch.bfloat16)
    assert torch.equal(linear(x_odd, w_odd), F.linear(x_odd, w_odd))


@gpu
def test_replays_in_a_cuda_graph_on_new_inputs(kernel):
    x, w, b = _inputs(1, 2048, 1024, torch.bfloat16, seed=4, bias=True)
    static_x = x.clone()
    graph, static_out = captured(lambda: linear(static_x, w, b))
    fresh, _, _ = _inputs(1, 2048, 1024, torch.bfloat16, seed=5)
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, linear(fresh, w, b))
    assert torch.equal(static_out, kernel.gemv(fresh, w, b))


# ---- GPU: SiLU(gate) * up or GELU-tanh(gate) * up applied by the GEMV to its own outputs --------------------------
@gpu
@pytest.mark.parametrize("activation", list(GATES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k", [(6144, 1024), (16384, 2048), (2048, 1024), (80, 64)],
                         ids=["wide", "wider", "narrow", "tiny"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_gated_output_gives_the_bits_of_the_gemv_then_the_activation_kernel(kernel, activation, dtype, n, k, bias):
    gate, reference = GATES[activation], REFERENCES[activation]
    for m in range(1, kernel.max_rows + 1):
        x, w, b = _inputs(m, n, k, dtype, seed=m, bias=bias)
        two_launches = gate_and_mul(kernel.gemv(x, w, b), gate)
        fused = kernel.gemv(x, w, b, gate)
        assert fused is not None and fused.shape == (m, n // 2)
        assert torch.equal(fused, two_launches)
        assert torch.equal(two_launches, reference(kernel.gemv(x, w, b)))  # the activation kernel is torch's
        if gemv_serves(m, n):
            assert torch.equal(linear_gate_and_mul(x, w, b, gate), fused)


@gpu
@pytest.mark.parametrize("activation,style", [("silu", "llama"), ("gelu_tanh", "gemma")])
def test_gated_output_with_a_normed_input_and_three_rows(kernel, activation, style):
    gate = GATES[activation]
    x = _normed(1, 1024, torch.bfloat16, seed=3, residual=True, style=style)
    _, w, b = _inputs(1, 6144, 1024, torch.bfloat16, seed=4, bias=True)
    expected, stream = _two_launches(_normed(1, 1024, torch.bfloat16, seed=3, residual=True, style=style), w, b,
                                     kernel)
    assert torch.equal(linear_gate_and_mul(x, w, b, gate), gate_and_mul(expected, gate))
    assert torch.equal(x.stream, stream)
    three, _, _ = _inputs(3, 6144, 1024, torch.bfloat16, seed=5)  # cuBLAS, then the activation kernel
    assert torch.equal(linear_gate_and_mul(three, w, b, gate), gate_and_mul(F.linear(three, w, b), gate))


@gpu
@pytest.mark.parametrize("activation", list(GATES))
def test_gated_output_replays_in_a_cuda_graph(kernel, activation):
    gate = GATES[activation]
    static, w, _ = _inputs(1, 6144, 1024, torch.bfloat16, seed=11)
    graph, out = captured(lambda: linear_gate_and_mul(static, w, None, gate))
    fresh, _, _ = _inputs(1, 6144, 1024, torch.bfloat16, seed=13)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gate_and_mul(kernel.gemv(fresh, w, None), gate))


# ---- GPU: RMSNorm(hidden + residual) formed by the GEMV ------------------------------------------------------
NORM_STYLES = {"llama": None, "float32": 0.0, "gemma": 1.0}  # weight_offset of each (layers.NORM_WEIGHT_OFFSETS)


def _normed(m: int, k: int, dtype: torch.dtype, seed: int, residual: bool, style: str) -> NormedInput:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = (torch.randn(m, k, device="cuda", generator=gen) * 3).to(dtype)
    r = (torch.randn(m, k, device="cuda", generator=gen) * 3).to(dtype) if residual else None
    norm_w = (torch.rand(k, device="cuda", generator=gen) + 0.5).to(dtype)
    return NormedInput(h, r, norm_w, 1e-6, NORM_STYLES[style])


def _two_launches(x: NormedInput, w: torch.Tensor, b: torch.Tensor | None, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """The RMSNorm kernel, then the GEMV: (output, stream)."""
    if x.residual is None:
        normed, stream = rms_norm(x.hidden, x.weight, x.eps, None, x.weight_offset), x.hidden
    else:
        normed, stream = rms_norm(x.hidden, x.weight, x.eps, x.residual, x.weight_offset)
    return kernel.gemv(normed, w, b), stream


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 1024), (6144, 512), (1024, 2048), (2048, 1536), (512, 8192)])
@pytest.mark.parametrize("style", sorted(NORM_STYLES))
@pytest.mark.parametrize("residual", [False, True], ids=["no-residual", "residual"])
def test_a_normed_input_gives_the_bits_of_the_norm_kernel_then_the_gemv(kernel, dtype, n, k, style, residual):
    for m in range(1, kernel.max_rows + 1):
        x = _normed(m, k, dtype, seed=m, residual=residual, style=style)
        _, w, b = _inputs(1, n, k, dtype, seed=20 + m, bias=True)
        expected, stream = _two_launches(x, w, b, kernel)
        fused = kernel.gemv_rms_norm(x, w, b)
        assert fused is not None and torch.equal(fused, expected)
        assert torch.equal(x.stream, stream)


@gpu
def test_linear_routes_a_normed_input_by_its_rows(kernel):
    layer = Linear(1024, 512, bias=False).to(device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    one = _normed(1, 1024, torch.bfloat16, seed=50, residual=True, style="llama")
    expected, _ = _two_launches(_normed(1, 1024, torch.bfloat16, seed=50, residual=True, style="llama"),
                                layer.weight, None, kernel)
    assert torch.equal(layer(one), expected)
    three = _normed(3, 1024, torch.bfloat16, seed=51, residual=True, style="llama")  # cuBLAS after the norm kernel
    normed, stream = rms_norm(three.hidden, three.weight, three.eps, three.residual)
    assert torch.equal(layer(three), F.linear(normed, layer.weight))
    assert torch.equal(three.stream, stream)


@gpu
def test_a_normed_input_replays_in_a_cuda_graph(kernel):
    static = _normed(1, 1024, torch.bfloat16, seed=60, residual=True, style="llama")
    _, w, _ = _inputs(1, 4096, 1024, torch.bfloat16, seed=61)
    graph, (out, stream) = captured(lambda: (kernel.gemv_rms_norm(static, w, None), static.stream))
    fresh = _normed(1, 1024, torch.bfloat16, seed=62, residual=True, style="llama")
    static.hidden.copy_(fresh.hidden)
    static.residual.copy_(fresh.residual)
    graph.replay()
    torch.cuda.synchronize()
    fresh.weight = static.weight  # the captured norm weight, with the new rows
    expected, expected_stream = _two_launches(fresh, w, None, kernel)
    assert torch.equal(out, expected) and torch.equal(stream, expected_stream)
