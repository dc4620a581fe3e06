"""Linear layers of small decode steps (pagednb/model/small_linear.py, kernels_cuda/gemv.cu).

`linear` is F.linear's contract. On CPU (always run) it is F.linear, and every projection of the decoder
goes through it. On a GPU (the H200 device; skipped elsewhere), for bf16/fp16 inputs of one row (two for
weights of fewer than 4,096 rows), where benchmarks/linear.py measured the kernel faster than cuBLAS:

  * each output is within one rounding of the exact (float64) product, plus the float32 accumulation
    error bound (K - 1) * 2^-24 * sum |x w|;
  * a row's output is bit for bit the same alone, beside another row, and in a CUDA graph replay: the
    order of its float32 sums depends only on the weight's shape;
  * strided rows and leading dimensions are served; inputs the kernel does not serve (3 rows, 2 rows of
    a wide weight, float32, misaligned rows, K % 8 != 0) are exactly F.linear.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_support import built_kernels, gpu

from pagednb.model import small_linear
from pagednb.model.small_linear import Linear, gemv_serves, linear

MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11}


# ---- CPU: the contract and the wiring -----------------------------------------------------------------
def test_linear_is_f_linear_on_cpu():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 5, 64, generator=gen), torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x, w), F.linear(x, w))


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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        linear(static_x, w, b)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = linear(static_x, w, b)
    fresh, _, _ = _inputs(1, 2048, 1024, torch.bfloat16, seed=5)
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, linear(fresh, w, b))
    assert torch.equal(static_out, kernel.gemv(fresh, w, b))
