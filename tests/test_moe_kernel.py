"""The fused MoE kernel (kernels_cuda/moe.cu) against the torch reference on the GPU: routing edge cases
(an expert with no tokens, every token on one expert, top-k 1/2/8, a token listing an expert twice), batch 1
to 8192 tokens, 8 and 128 experts, shapes that do not fill a tile, and a CUDA graph replayed with new
routing. Up to 16 tokens the kernel routes inside each CTA and combines in the down GEMM ("direct" tiles):
those outputs must equal, bit for bit, the same rows computed by the routed path at 17 tokens. From 64 rows
per expert in bf16 fused_moe takes torch._grouped_mm's path, checked against the reference and the kernel.

Tolerance: the oracle is the reference run in float32 on the same bf16/fp16 inputs. The kernel rounds
gate, up, silu, the product and the down projection to the model dtype, as HF does, so each output is off
by a few units of the 16-bit type's last place (2^-8 relative in bf16): we allow 2^-6 of the row's scale
(|ref| max over the row) plus 2^-6 relative. A wrong expert, weight or token moves outputs by O(1) of the
scale, far beyond this.
"""
from __future__ import annotations

import pytest
import torch
from gpu_support import built_kernels, captured, gpu

from pagednb.model import fused_moe as moe_ops

TOL = 2.0 ** -6


def make_experts(E: int, H: int, I: int, dtype: torch.dtype, gen: torch.Generator):
    w13 = (torch.randn(E, 2 * I, H, generator=gen, device="cuda") / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen, device="cuda") / I ** 0.5).to(dtype)
    return w13, w2


def random_routing(T: int, E: int, top_k: int, gen: torch.Generator, allowed: list[int] | None = None):
    """(weights [T, top_k] float32, ids [T, top_k] int64): distinct experts per token from `allowed`."""
    pool = torch.tensor(allowed if allowed is not None else list(range(E)), device="cuda")
    scores = torch.rand(T, len(pool), generator=gen, device="cuda")
    ids = pool[scores.topk(top_k, dim=-1).indices]
    weights = torch.rand(T, top_k, generator=gen, device="cuda") + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


def check_against_reference(hidden, w13, w2, weights, ids) -> None:
    out = moe_ops.fused_moe(hidden, w13, w2, weights, ids)
    ref = moe_ops.fused_moe_reference(hidden.float(), w13.float(), w2.float(), weights, ids)
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    scale = ref.abs().amax(dim=-1, keepdim=True)
    err = (out.float() - ref).abs()
    bad = err > TOL * scale + TOL * ref.abs()
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outputs off; worst {float(err.max()):.3g} "
                           f"at scale {float(scale.max()):.3g}")


@pytest.fixture(scope="module")
def kernel():
    return built_kernels(moe_ops.KERNEL.get)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,E,top_k", [(1, 8, 2), (1, 128, 8), (16, 128, 8), (16, 8, 8), (37, 8, 1), (256, 128, 8),
                                       (300, 8, 2), (8192, 128, 8)])
def test_kernel_matches_reference(kernel, dtype, T, E, top_k):
    gen = torch.Generator("cuda").manual_seed(T * 1000 + E + top_k)
    H, I = 256, 96  # I = 96: the gate/up column tiles (32 or 64) and down K-tiles (64) are partly empty
    w13, w2 = make_experts(E, H, I, dtype, gen)
    hidden = torch.randn(T, H, generator=gen, device="cuda").to(dtype)
    weights, ids = random_routing(T, E, top_k, gen)
    assert kernel.fused_moe(hidden, w13, w2, weights, ids) is not None  # the kernel, not the fallback, ran
    check_against_reference(hidden, w13, w2, weights, ids)


@gpu
@pytest.mark.parametrize("T", [1, 64, 2048])
def test_an_expert_with_no_tokens_and_all_tokens_on_one_expert(kernel, T):
    gen = torch.Generator("cuda").manual_seed(T)
    E, H, I = 8, 128, 64
    w13, w2 = make_experts(E, H, I, torch.bfloat16, gen)
    hidden = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = random_routing(T, E, 2, gen, allowed=[0, 1, 2, 4, 5, 6, 7])  # expert 3 idle
    check_against_reference(hidden, w13, w2, weights, ids)
    one = torch.full((T, 1), 5, device="cuda")
    check_against_reference(hidden, w13, w2, torch.ones(T, 1, device="cuda"), one)
    two = torch.tensor([[5, 6]], device="cuda").expand(T, 2).contiguous()  # every token on the same two
    check_against_reference(hidden, w13, w2, weights, two)


@gpu
def test_real_model_dims_qwen3_30b_a3b_layer(kernel):
    gen = torch.Generator("cuda").manual_seed(0)
    E, H, I, top_k = 128, 2048, 768, 8
    w13, w2 = make_experts(E, H, I, torch.bfloat16, gen)
    for T in (1, 256, 4096):
        hidden = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
        check_against_reference(hidden, w13, w2, *random_routing(T, E, top_k, gen))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_routing_weights_in_the_model_dtype_as_qwen3_moe_rounds_them(kernel, dtype):
    """Qwen3-MoE's router returns weights in the model dtype (read as they are); another dtype is converted."""
    gen = torch.Generator("cuda").manual_seed(3)
    E, H, I, T, top_k = 16, 128, 64, 64, 4
    w13, w2 = make_experts(E, H, I, dtype, gen)
    hidden = torch.randn(T, H, generator=gen, device="cuda").to(dtype)
    weights, ids = random_routing(T, E, top_k, gen)
    check_against_reference(hidden, w13, w2, weights.to(dtype), ids)
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    check_against_reference(hidden, w13, w2, weights.to(other), ids)


@gpu
def test_strided_hidden_rows_are_read_in_place(kernel):
    gen = torch.Generator("cuda").manual_seed(1)
    E, H, I, T = 8, 128, 64, 33
    w13, w2 = make_experts(E, H, I, torch.bfloat16, gen)
    wide = torch.randn(T, 2 * H, generator=gen, device="cuda").to(torch.bfloat16)
    hidden = wide[:, H:]  # row stride 2H
    weights, ids = random_routing(T, E, 2, gen)
    assert kernel.fused_moe(hidden, w13, w2, weights, ids) is not None
    check_against_reference(hidden, w13, w2, weights, ids)


@gpu
@pytest.mark.parametrize("T,E,top_k", [(1, 128, 8), (3, 8, 2), (8, 8, 8), (16, 128, 8)])
def test_direct_tiles_equal_the_routed_path_bit_for_bit(kernel, T, E, top_k):
    """The first T rows of a (T + 1)-token call (routing kernel, the same 16-row tiles (under 12 rows per expert
    at T + 1), combine kernel) are
    the T-token call's output exactly: every row is computed alone in both paths, in the same order."""
    gen = torch.Generator("cuda").manual_seed(10 * T + E)
    H, I = 2048, 768
    w13, w2 = make_experts(E, H, I, torch.bfloat16, gen)
    hidden = torch.randn(T + 1, H, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = random_routing(T + 1, E, top_k, gen)
    routed = kernel.fused_moe(hidden, w13, w2, weights, ids)
    direct = kernel.fused_moe(hidden[:T], w13, w2, weights[:T].contiguous(), ids[:T].contiguous())
    assert torch.equal(direct, routed[:T])
    check_against_reference(hidden[:T], w13, w2, weights[:T], ids[:T])


@gpu
@pytest.mark.parametrize("T", [1, 5, 16, 40])
def test_a_token_listing_an_expert_twice(kernel, T):
    """Each listing counts (the reference adds both): up to 16 tokens an expert then has up to 4 * T rows,
    more than one 16-row tile, which the direct tile runs in several chunks."""
    gen = torch.Generator("cuda").manual_seed(T)
    E, H, I = 8, 256, 96
    w13, w2 = make_experts(E, H, I, torch.bfloat16, gen)
    hidden = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    weights, _ = random_routing(T, E, 4, gen)
    ids = torch.full((T, 4), 3, device="cuda")
    ids[:, 3] = 6  # expert 3 three times per token, expert 6 once
    assert kernel.fused_moe(hidden, w13, w2, weights, ids) is not None
    check_against_reference(hidden, w13, w2, weights, ids)


@gpu
def test_prefill_sized_bf16_calls_take_grouped_mm_and_agree_with_the_kernel(kernel):
    """From 64 rows per expert in bf16 fused_moe runs torch._grouped_mm's path (Hopper: the H200 has it);
    fp16 and smaller calls keep the kernel. Both paths within bf16 rounding of the reference and of each
    other."""
    gen = torch.Generator("cuda").manual_seed(7)
    E, H, I, top_k, T = 128, 2048, 768, 8, 2048
    w13, w2 = make_experts(E, H, I, torch.bfloat16, gen)
    hidden = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = random_routing(T, E, top_k, gen)
    assert moe_ops.grouped_mm_serves(hidden, w13, w2, ids)
    assert moe_ops.grouped_mm_serves(hidden[:T // 2], w13, w2, ids[:T // 2])  # 64 rows per expert
    assert not moe_ops.grouped_mm_serves(hidden[:T // 4], w13, w2, ids[:T // 4])  # 32
    assert not moe_ops.grouped_mm_serves(hidden.half(), w13.half(), w2.half(), ids)
    check_against_reference(hidden, w13, w2, weights, ids)
    ours = kernel.fused_moe(hidden, w13, w2, weights, ids).float()
    grouped = moe_ops.fused_moe(hidden, w13, w2, weights, ids).float()
    scale = ours.abs().amax(dim=-1, keepdim=True)
    assert ((grouped - ours).abs() <= TOL * (scale + ours.abs())).all()


@gpu
@pytest.mark.parametrize("T", [4, 48])
def test_captured_in_a_cuda_graph_and_replayed_with_new_routing(kernel, T):
    """No host sync and only shape-dependent grids: a graph captured once serves any later routing (4 tokens:
    the direct tiles, whose combine counters the graph must reset on every replay; 48: the routed path)."""
    gen = torch.Generator("cuda").manual_seed(2)
    E, H, I, top_k = 64, 256, 128, 4
    w13, w2 = make_experts(E, H, I, torch.bfloat16, gen)
    hidden = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = random_routing(T, E, top_k, gen)
    graph, out = captured(lambda: moe_ops.fused_moe(hidden, w13, w2, weights, ids))
    for round_ in range(3):
        new_weights, new_ids = random_routing(T, E, top_k, gen, allowed=list(range(round_, E, 3)))
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        hidden.copy_(torch.randn(T, H, generator=gen, device="cuda"))
        graph.replay()
        ref = moe_ops.fused_moe_reference(hidden.float(), w13.float(), w2.float(), weights, ids)
        scale = ref.abs().amax(dim=-1, keepdim=True)
        assert ((out.float() - ref).abs() <= TOL * scale + TOL * ref.abs()).all()
