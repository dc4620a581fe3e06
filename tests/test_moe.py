"""Mixture-of-experts models (Qwen3MoeForCausalLM, MixtralForCausalLM) against HF transformers.

On the CPU in float32: prefill logits within 1e-4 of HF's (whole and chunked over the paged cache), and
greedy outputs equal to HF's `generate` under chunked prefill, prefix-cache hits and preemption. The
routing (softmax, top-k, renormalisation, dtype) is checked against HF's router modules themselves, the
layer layout (decoder_sparse_step, mlp_only_layers) against the config, and every checkpoint spelling of
the experts (per expert as Qwen3-MoE and Mixtral save them, stacked as transformers 5 holds them) loads to
the same model. On a GPU: bf16 through the fused MoE kernel, equal to HF in bf16 except at near-ties.
The kernel itself is tested against the torch reference in test_moe_kernel.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_support import built_kernels, captured, gpu
from test_model_equivalence import ATOL, PagedCache, hf_logits, prompt, run
from tiny import EQUIVALENCE_PROMPTS as PROMPTS, hf_greedy, load_model_pair, make_tiny_model

from pagednb import LLM, SamplingParams
from pagednb.attention import TorchReferenceBackend
from pagednb.model import load_hf_config, load_model, model_spec
from pagednb.model.fused_moe import KERNEL, fused_moe, fused_moe_reference, select_experts, select_experts_reference
from pagednb.model.layers import GatedMLP
from pagednb.model.moe import SparseMoeBlock

# name -> (HF model_type, config overrides)
MODELS = {
    # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse; top-k weights renormalised
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True,
                                    mlp_only_layers=[1])),
    # every second layer sparse; top-k weights as softmax gives them (no renormalisation)
    "qwen3_moe_step2": ("qwen3_moe", dict(head_dim=16, num_hidden_layers=4, num_experts=6, num_experts_per_tok=3,
                                          moe_intermediate_size=24, intermediate_size=64, norm_topk_prob=False,
                                          decoder_sparse_step=2)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    # every layer attends through a window of 8: the prompts below are up to 9 windows long
    "mixtral_sliding": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                                        sliding_window=8)),
}
MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    model_type, overrides = MODELS[request.param]
    return request.param, make_tiny_model(tmp_path_factory.mktemp(request.param), model_type, **overrides)


@pytest.fixture(scope="module")
def models(checkpoint):
    """(pagednb model, HF model) of one checkpoint, float32 on the CPU."""
    return load_model_pair(checkpoint[1])


@pytest.fixture(scope="module")
def references(checkpoint) -> list[list[int]]:
    return hf_greedy(checkpoint[1], PROMPTS, MAX_NEW)


# ---- layout and routing ------------------------------------------------------------------------------------
def test_sparse_and_dense_layers_follow_the_config(models, checkpoint):
    ours, theirs = models
    kinds = [type(layer.mlp) for layer in ours.model.layers]
    hf_sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in theirs.model.layers]
    assert [k is SparseMoeBlock for k in kinds] == hf_sparse
    assert set(kinds) <= {SparseMoeBlock, GatedMLP}
    expected = {"qwen3_moe": [True, False, True], "qwen3_moe_step2": [False, True, False, True],
                "mixtral": [True, True], "mixtral_sliding": [True, True]}[checkpoint[0]]
    assert hf_sparse == expected


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_matches_hf_routers(dtype):
    """Softmax in float32, top-k, renormalised where the architecture says, weights in the dtype HF returns."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    for norm in (True, False):
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                                                   norm_topk_prob=norm))
        torch.nn.init.normal_(router.weight)
        router.to(dtype)
        logits, weights, ids = router(x)
        ours = select_experts(logits, 4, renormalize=norm, weights_in_logits_dtype=True)
        assert torch.equal(ours[1], ids) and ours[0].dtype == weights.dtype and torch.equal(ours[0], weights)
    router = MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2))
    torch.nn.init.normal_(router.weight)
    router.to(dtype)
    logits, weights, ids = router(x)
    ours = select_experts(logits, 2, renormalize=True, weights_in_logits_dtype=False)
    assert torch.equal(ours[1], ids) and ours[0].dtype == torch.float32 and torch.equal(ours[0], weights)


def test_reference_is_the_weighted_sum_of_each_tokens_experts():
    """fused_moe_reference against the definition, one token and one slot at a time."""
    gen = torch.Generator().manual_seed(0)
    T, H, I, E, k = 9, 16, 8, 5, 3
    hidden, w13, w2 = torch.randn(T, H, generator=gen), torch.randn(E, 2 * I, H, generator=gen), torch.randn(
        E, H, I, generator=gen)
    weights, ids = select_experts(torch.randn(T, E, generator=gen), k, True, False)
    ids[0] = torch.tensor([4, 0, 2])  # expert 1 and 3 may be idle; 4 is hit
    expected = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            gate, up = (w13[ids[t, j]] @ hidden[t]).chunk(2)
            expected[t] += weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(fused_moe_reference(hidden, w13, w2, weights, ids), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["random", "idle_experts", "one_expert", "expert_twice_per_token"])
def test_grouped_mm_path_is_the_weighted_sum_of_each_tokens_experts(dtype, routing):
    """grouped_mm_moe (the prefill-sized calls' path on the GPU: sort by expert, torch._grouped_mm, put back,
    one bmm) on the CPU against the reference: exact in float32 up to the sums' order, within bf16 rounding
    in bf16. Routings with idle experts (empty groups), all pairs on one expert, and a token listing an
    expert twice."""
    from pagednb.model.fused_moe import grouped_mm_moe

    gen = torch.Generator().manual_seed(1)
    T, H, I, E, k = 40, 32, 16, 8, 2
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(dtype)
    weights, ids = select_experts(torch.randn(T, E, generator=gen), k, True, False)
    if routing == "idle_experts":
        ids = ids % 3 * 2  # experts 0, 2, 4 only (a token may list one twice)
    elif routing == "one_expert":
        ids = torch.full_like(ids, 5)
    elif routing == "expert_twice_per_token":
        ids[:, 1] = ids[:, 0]
    ref = fused_moe_reference(hidden.float(), w13.float(), w2.float(), weights, ids)
    out = grouped_mm_moe(hidden, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (T, H)
    scale = ref.abs().amax(dim=-1, keepdim=True)
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -6
    assert ((out.float() - ref).abs() <= tol * (scale + ref.abs())).all()


def test_the_memory_estimate_counts_every_expert():
    """Qwen3-30B-A3B's config: 30.5B parameters (the start-up memory check sizes the weights by it)."""
    from transformers import Qwen3MoeConfig

    from pagednb.model.spec import estimate_num_parameters

    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                         num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False)
    assert 30.0e9 < estimate_num_parameters(cfg) < 30.6e9


def test_a_config_asking_more_experts_per_token_than_exist_is_refused(tmp_path):
    path = make_tiny_model(tmp_path / "m", "mixtral", num_local_experts=4, num_experts_per_tok=2,
                           intermediate_size=48)
    cfg = load_hf_config(path)
    cfg.num_experts_per_tok = 5
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        load_model(path, cfg, model_spec(cfg), torch.float32, torch.device("cpu"), TorchReferenceBackend())


# ---- logits, float32 on the CPU -----------------------------------------------------------------------
def test_prefill_logits_match_hf(models):
    ours, theirs = models
    ids = prompt(37, seed=0)
    logits = run(ours, PagedCache(ours.spec, 1, 40), ids, [(0, 0, len(ids))])
    torch.testing.assert_close(logits, hf_logits(theirs, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode_over_the_cache_match_hf(models):
    ours, theirs = models
    ids = prompt(41, seed=1)
    cache, pieces, start = PagedCache(ours.spec, 1, 48), [], 0
    for n in (7, 1, 12, 1, 1, 19):
        pieces.append(run(ours, cache, ids[start:start + n], [(0, start, n)]))
        start += n
    torch.testing.assert_close(torch.cat(pieces), hf_logits(theirs, ids), atol=ATOL, rtol=0)


SPELLINGS = {  # checkpoint name of (router, expert e's gate / up / down) in layer i, or of the stacked tensors
    "qwen3_moe": ("model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.experts.{e}.{proj}.weight",
                  {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("model.layers.{i}.block_sparse_moe.gate.weight",
                "model.layers.{i}.block_sparse_moe.experts.{e}.{proj}.weight", {"gate": "w1", "up": "w3", "down": "w2"}),
    "stacked": ("model.layers.{i}.mlp.gate.weight", None, None),  # transformers 5: mlp.experts.gate_up_proj
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_every_checkpoint_spelling_of_the_experts_loads_the_same_model(models, checkpoint, tmp_path, spelling):
    """The experts written per expert (Qwen3-MoE's or Mixtral's names) or stacked: the same logits as HF."""
    from safetensors.torch import load_file, save_file

    ours, theirs = models
    path = checkpoint[1]
    tensors = {k: v for k, v in load_file(str(path / "model.safetensors")).items()
               if ".experts." not in k and not k.endswith(".gate.weight") and "experts" not in k.rsplit(".", 1)[-1]}
    router_name, expert_name, projs = SPELLINGS[spelling]
    for i, layer in enumerate(ours.model.layers):
        if not isinstance(layer.mlp, SparseMoeBlock):
            continue
        w13, w2 = layer.mlp.experts.w13.detach(), layer.mlp.experts.w2.detach()
        tensors[router_name.format(i=i)] = layer.mlp.gate.weight.detach().clone()
        if expert_name is None:
            tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = w13.clone()
            tensors[f"model.layers.{i}.mlp.experts.down_proj"] = w2.clone()
            continue
        for e, (gate, up) in enumerate(w.chunk(2) for w in w13):
            for kind, value in (("gate", gate), ("up", up), ("down", w2[e])):
                tensors[expert_name.format(i=i, e=e, proj=projs[kind])] = value.clone()
    out = tmp_path / spelling
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    cfg = load_hf_config(out)
    loaded = load_model(out, cfg, model_spec(cfg), torch.float32, torch.device("cpu"), TorchReferenceBackend())
    ids = prompt(20, seed=3)
    logits = run(loaded, PagedCache(loaded.spec, 1, 24), ids, [(0, 0, len(ids))])
    torch.testing.assert_close(logits, hf_logits(theirs, ids), atol=ATOL, rtol=0)


# ---- greedy through the engine, float32 on the CPU ---------------------------------------------------------
def generate_all(path, **engine_args):
    with LLM(str(path), dtype="float32", **engine_args) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.stats()
        llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs], stats


def test_greedy_with_chunked_prefill_matches_hf(checkpoint, references):
    got, _ = generate_all(checkpoint[1], num_kv_blocks=64, max_num_batched_tokens=7)
    assert got == references


def test_greedy_with_prefix_hits_matches_hf(checkpoint, references):
    with LLM(str(checkpoint[1]), dtype="float32", num_kv_blocks=64) as llm:
        first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        hits = llm.stats()["prefix_cache_hit_tokens"]
        sliding = llm.engine.spec.sliding_window is not None
    assert [o.outputs[0].token_ids for o in first] == references
    assert [o.outputs[0].token_ids for o in second] == references
    assert hits > 0 or sliding  # (every layer sliding: no prefix to reuse past the window)


def test_greedy_with_preemption_matches_hf(checkpoint, references):
    got, stats = generate_all(checkpoint[1], num_kv_blocks=8, max_model_len=112, max_num_batched_tokens=7)
    assert got == references
    assert stats["preemptions"] > 0 or checkpoint[0] == "mixtral_sliding"  # (blocks past the window are freed)


# ---- on the GPU -------------------------------------------------------------------------------------------
@gpu
def test_gpu_float32_matches_hf(checkpoint, references):
    """float32 on the GPU: the MoE layers on their torch reference (the kernel is bf16/fp16; under the decode
    CUDA graphs the reference runs every expert, weighted 0 where not chosen), attention on the CUDA kernels."""
    with LLM(str(checkpoint[1]), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16) as llm:
        assert llm.engine.device.type == "cuda"
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references


ROUTER_TIE = 2.0 ** -5  # relative gap between the k-th and (k+1)-th router probabilities that bf16 can flip


def routing_nearly_ties(hf, ids: list[int]) -> bool:
    """Whether one of HF's routers, for the last token of ids, nearly ties between the last expert it picks
    and the next one: there a 1-ulp difference in the hidden state (another kernel's summation order)
    picks another expert, and the next token may change although no logits nearly tie."""
    top_k = hf.config.num_experts_per_tok
    out = hf(torch.tensor([ids], device="cuda"), output_router_logits=True)
    for logits in out.router_logits:
        probs = logits[-1].float().softmax(-1).sort(descending=True).values
        if probs[top_k - 1] - probs[top_k] <= ROUTER_TIE * probs[top_k - 1]:
            return True
    return False


@gpu
@torch.no_grad()
def test_gpu_bfloat16_is_as_faithful_as_hf_bfloat16(checkpoint):
    """bf16 through the fused MoE kernel, CUDA graphs on. In a tiny random MoE model bf16 noise flips routing
    decisions (8 experts, top-2) and continuations part from HF's bf16 ones within a few tokens, so token
    equality is the wrong bar; the float32 model is the oracle instead. Along pagednb's continuation (teacher
    forced), its token must be float32 HF's argmax about as often as HF's own bf16 argmax is: a wrong expert,
    weight or rounding would miss at most positions. And where pagednb first leaves HF's bf16 continuation,
    HF's logits there must nearly tie, or one of its routers must."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagednb.model.fused_moe import KERNEL

    assert KERNEL.get() is not None, "the fused MoE kernel must build on the GPU"
    path = checkpoint[1]
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    with LLM(str(path), dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=16) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ours_off = hf_off = positions = 0
    for text, out in zip(PROMPTS, outs):
        ids, got = tok(text).input_ids, list(out.outputs[0].token_ids)
        context = torch.tensor([ids + got], device="cuda")
        rows = slice(len(ids) - 1, len(ids) + len(got) - 1)  # the logits that chose each generated token
        truth = oracle(context).logits[0, rows].argmax(-1)
        ours_off += int((torch.tensor(got, device="cuda") != truth).sum())
        hf_off += int((hf(context).logits[0, rows].argmax(-1) != truth).sum())
        positions += len(got)
        ref = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=MAX_NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        if got != ref:
            i = next(j for j, (a, b) in enumerate(zip(got, ref)) if a != b)
            logits = hf(torch.tensor([ids + got[:i]], device="cuda")).logits[0, -1].float()
            near_tie = logits[ref[i]] - logits[got[i]] <= 0.1
            assert near_tie or routing_nearly_ties(hf, ids + got[:i]), (text, i, got, ref)
    assert ours_off <= 2 * hf_off + positions // 20, (ours_off, hf_off, positions)


# ---- the routing kernel (select_experts on a GPU) -------------------------------------------------------------
def distinct_logits(T: int, E: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Router logits whose rows hold E distinct values (a shuffled ramp, exact in dtype): the top k is unique,
    so the kernel's choice and torch's must agree expert for expert."""
    gen = torch.Generator("cuda").manual_seed(seed)
    ramp = torch.rand(T, E, generator=gen, device="cuda").argsort(dim=-1).float() - E / 2
    return (ramp * (8.0 / E)).to(dtype)


def weight_rtol(weights: torch.Tensor) -> float:
    """float32: the sums' order (kernel vs torch) moves the last bits; 16-bit: one ulp after rounding."""
    return {torch.float32: 2.0 ** -16, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[weights.dtype]


def check_routing(logits: torch.Tensor, top_k: int, renormalize: bool, in_logits_dtype: bool) -> None:
    got = KERNEL.get().select_experts(logits, top_k, renormalize, in_logits_dtype)
    assert got is not None, "the routing kernel must cover these logits"
    want = select_experts_reference(logits, top_k, renormalize, in_logits_dtype)
    assert got[1].dtype == torch.int64 and torch.equal(got[1], want[1])
    assert got[0].dtype == want[0].dtype
    torch.testing.assert_close(got[0], want[0], rtol=weight_rtol(want[0]), atol=0)


class _FakeMoeLib:
    """Stands in for the CUDA library with bindings.cpp's tables; any kernel call fails the test."""

    def pagednb_moe_select_experts(self, *args):
        raise AssertionError("the routing kernel should have declined")

    @staticmethod
    def pagednb_dtype_name(code: int) -> bytes | None:
        return (b"float32", b"float16", b"bfloat16", None)[code]

    @staticmethod
    def pagednb_moe_max_experts() -> int:
        return 1024

    @staticmethod
    def pagednb_moe_max_topk() -> int:
        return 32


@pytest.mark.parametrize("case", ["float32", "3d", "experts_strided", "too_many_experts", "top_k_above_32",
                                  "top_k_above_experts", "top_k_0"])
def test_routing_the_kernel_leaves_to_torch(case):
    """Logits the routing kernel does not take are declined before any launch (select_experts then routes
    them in torch)."""
    from pagednb.model.fused_moe import MoeKernel

    logits, top_k = torch.randn(3, 64, dtype=torch.bfloat16), 4
    if case == "float32":
        logits = logits.float()
    elif case == "3d":
        logits = logits.view(3, 4, 16)
    elif case == "experts_strided":
        logits = logits[:, ::2]
    elif case == "too_many_experts":
        logits = torch.zeros(3, 1025, dtype=torch.bfloat16)
    else:
        top_k = {"top_k_above_32": 33, "top_k_above_experts": 65, "top_k_0": 0}[case]
    assert MoeKernel(_FakeMoeLib()).select_experts(logits, top_k, True, True) is None


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,E,top_k", [(1, 128, 8), (37, 128, 8), (8192, 128, 8), (5, 8, 2), (16, 60, 1),
                                       (3, 256, 32)])
def test_gpu_routing_kernel_matches_torch(dtype, T, E, top_k):
    """Experts in torch.topk's order (descending), weights as HF computes them, for every routing variant."""
    built_kernels(KERNEL.get)
    logits = distinct_logits(T, E, dtype, seed=T + E + top_k)
    for renormalize in (True, False):
        for in_logits_dtype in (True, False):
            check_routing(logits, top_k, renormalize, in_logits_dtype)


@gpu
def test_gpu_routing_kernel_ties_strided_rows_and_what_it_leaves_to_torch():
    kernel = built_kernels(KERNEL.get)
    even = torch.zeros(4, 16, dtype=torch.bfloat16, device="cuda")  # every expert ties: the lowest ids win
    weights, ids = kernel.select_experts(even, 3, False, False)
    assert ids.tolist() == [[0, 1, 2]] * 4 and torch.equal(weights, torch.full((4, 3), 1 / 16, device="cuda"))
    wide = distinct_logits(9, 96, torch.bfloat16, seed=5)
    check_routing(wide[:, 16:80], 4, True, True)  # rows of a wider tensor, read in place (row stride 96)
    assert kernel.select_experts(wide.float(), 4, True, True) is None  # float32: torch routes
    assert kernel.select_experts(wide, 33, True, True) is None  # more than 32 per token: torch routes
    want = select_experts(wide.float(), 4, True, True)  # and select_experts still answers
    assert torch.equal(want[1], select_experts(wide, 4, True, True)[1])


@gpu
def test_gpu_routing_and_experts_captured_in_a_cuda_graph():
    """Routing kernel and fused MoE in one graph, replayed on new logits: no host sync anywhere."""
    built_kernels(KERNEL.get)
    T, E, top_k = 24, 32, 4
    w13, w2, hidden = random_bf16_layer(T, E, 128, 64, seed=4)
    logits = distinct_logits(T, E, torch.bfloat16, seed=0)

    def layer():
        return fused_moe(hidden, w13, w2, *select_experts(logits, top_k, True, True))

    graph, out = captured(layer)
    for seed in (1, 2):
        logits.copy_(distinct_logits(T, E, torch.bfloat16, seed))
        graph.replay()
        assert_bf16_close_to_reference(out, hidden, w13, w2, *select_experts_reference(logits, top_k, True, True))


@gpu
def test_gpu_16_row_tiles_with_experts_spanning_several_tiles():
    """160 tokens of Qwen3-30B-A3B's layer take the 16-row tiles (10 rows per expert on average); routed to
    40 of the 128 experts, each of those has ~32 rows, so its rows span several tiles."""
    kernel = built_kernels(KERNEL.get)
    T, E, top_k = 160, 128, 8
    w13, w2, hidden = random_bf16_layer(T, E, 2048, 768, seed=6)
    logits = distinct_logits(T, E, torch.bfloat16, seed=6)
    logits[:, 40:] -= 16.0  # experts 40.. never in a token's top 8
    weights, ids = select_experts(logits, top_k, True, True)
    assert int(ids.max()) < 40 and int(torch.bincount(ids.flatten()).max()) > 16
    assert_bf16_close_to_reference(kernel.fused_moe(hidden, w13, w2, weights, ids), hidden, w13, w2, weights, ids)


def random_bf16_layer(T: int, E: int, H: int, I: int, seed: int):
    """(w13 [E, 2I, H], w2 [E, H, I], hidden [T, H]) in bf16 on the GPU, scaled like a trained layer's."""
    gen = torch.Generator("cuda").manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=gen, device="cuda") / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=gen, device="cuda") / I ** 0.5).to(torch.bfloat16)
    return w13, w2, torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)


def assert_bf16_close_to_reference(out, hidden, w13, w2, weights, ids):
    """Within bf16 rounding (2^-6 of the row's scale plus the element) of the float32 reference MLP."""
    ref = fused_moe_reference(hidden.float(), w13.float(), w2.float(), weights, ids)
    scale = ref.abs().amax(dim=-1, keepdim=True)
    assert ((out.float() - ref).abs() <= 2.0 ** -6 * (scale + ref.abs())).all()
