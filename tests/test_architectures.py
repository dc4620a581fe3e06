"""Gemma 2, Gemma 3, Phi-3, OLMo 2 and Granite: pagednb's decoder flavours against HF transformers.

Each tiny random config turns on every switch its architecture has: soft-capped attention scores and
logits, query_pre_attn_scalar, sliding windows shorter than the prompts, a RoPE per layer type (Gemma 3),
partial rotary and LongRoPE past the pretraining length (Phi-3), q/k norms over the whole projection and
post-norms only (OLMo 2), multipliers != 1 (Granite); norm weights are randomised so that each norm
style's rounding and Gemma's (1 + w) matter. On the CPU in float32: logits within 1e-4 of HF's, and
greedy outputs equal to HF's `generate` under chunked prefill, prefix-cache hits and preemption (Phi-3: up
to where a sequence outgrows its pretraining length, see comparable_lengths). On a GPU:
the same with pagednb's CUDA kernels in float32 (exact), and in bfloat16 equal to HF in bfloat16 except
where HF's own top two logits nearly tie.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_support import CUDA, GPU_REASON
from test_model_equivalence import ATOL, PagedCache, hf_logits, prompt, run
from tiny import EQUIVALENCE_PROMPTS as PROMPTS, hf_greedy, load_model_pair, make_tokenizer, tiny_config

from pagednb import LLM, SamplingParams
from pagednb.attention import TorchReferenceBackend
from pagednb.model import build_model, load_hf_config, model_spec

HEAD_DIM = 16
PHI3_PRETRAINED_LEN = 80  # the longest prompt has 72 tokens
# name -> (HF model_type, config overrides); every HF architecture here is checked by test_registry. Gemma's
# LM head is untied here: tied to sqrt(hidden)-scaled random embeddings, a tiny model only repeats its input
# token, which would make every greedy comparison trivial (tied heads: test_model_equivalence).
ARCHITECTURES = {
    "gemma2": ("gemma2", dict(head_dim=HEAD_DIM, num_hidden_layers=3, query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=5.0, sliding_window=8)),
    "gemma3": ("gemma3_text", dict(
        head_dim=HEAD_DIM, num_hidden_layers=3, query_pre_attn_scalar=24, final_logit_softcapping=5.0,
        sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})),
    # rotary over half of each head; LongRoPE's long factors from position 80 on (see rotary._longrope)
    "phi3": ("phi3", dict(sliding_window=16, original_max_position_embeddings=PHI3_PRETRAINED_LEN, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.5, 2.0, 4.0], "long_factor": [1.0, 3.0, 7.0, 20.0]})),
    "olmo2": ("olmo2", dict(attention_bias=True)),
    "granite": ("granite", dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
                                logits_scaling=4.0, attention_bias=True, mlp_bias=True)),
}
SLIDING = {"gemma2": 8, "gemma3": 8, "phi3": 16}  # the window of the sliding layers
MAX_NEW = 24
MAX_MODEL_LEN = 112  # the longest prompt and its tokens fit
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def make_model(path: Path, name: str) -> Path:
    """A random float32 checkpoint of ARCHITECTURES[name] with the tiny tokenizer; norm weights are
    perturbed (HF initialises them to 1, or 0 for Gemma's 1 + w, where a wrong style would not show)."""
    from transformers import AutoModelForCausalLM

    model_type, overrides = ARCHITECTURES[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path)
    return path


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def models(checkpoint):
    """(pagednb model, HF model) of one checkpoint, float32 on the CPU."""
    return load_model_pair(checkpoint[1])


@pytest.fixture(scope="module")
def references(checkpoint) -> list[list[int]]:
    return hf_references(checkpoint[1])


def hf_references(path: Path) -> list[list[int]]:
    """HF's greedy outputs with its eager attention, which computes every architecture here in full: under
    transformers 5.17 Gemma 2's default ("sdpa") drops the attention soft-cap (issue 15)."""
    return hf_greedy(path, PROMPTS, MAX_NEW, attn_implementation="eager")


# ---- the flavour's switches are really on --------------------------------------------------------------
def test_each_config_turns_its_switches_on(checkpoint):
    name, path = checkpoint
    cfg = load_hf_config(path)
    spec = model_spec(cfg)
    window = SLIDING.get(name)
    assert set(spec.sliding_windows) - {None} == ({window} if window else set())
    if name in ("gemma2", "gemma3"):
        assert None in spec.sliding_windows  # global layers between the sliding ones
    with torch.device("meta"):
        model = build_model(spec, cfg, TorchReferenceBackend())
    names = {n for n, _ in model.named_parameters()}
    expected = {
        "gemma2": "model.layers.0.pre_feedforward_layernorm.weight",
        "gemma3": "model.layers.0.self_attn.q_norm.weight",
        "phi3": "model.layers.0.self_attn.qkv_proj.weight",
        "olmo2": "model.layers.0.post_feedforward_layernorm.weight",
        "granite": "model.layers.0.mlp.down_proj.bias",
    }[name]
    assert expected in names
    if name == "olmo2":
        assert "model.layers.0.input_layernorm.weight" not in names  # post-norms only
        assert model.model.layers[0].self_attn.q_norm.weight.shape == (cfg.num_attention_heads * HEAD_DIM,)


# ---- logits, float32 on the CPU -----------------------------------------------------------------------
def test_prefill_logits_match_hf(models):
    ours, theirs = models
    ids = prompt(37, seed=0)  # longer than every sliding window
    logits = run(ours, PagedCache(ours.spec, 1, 40), ids, [(0, 0, len(ids))])
    torch.testing.assert_close(logits, hf_logits(theirs, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode_over_the_cache_match_hf(models):
    ours, theirs = models
    ids = prompt(96, seed=1)  # past Phi-3's pretraining length (80): long factors in the decode steps
    cache, pieces, start = PagedCache(ours.spec, 1, 96), [], 0
    for n in (7, 1, 12, 1, 1, 19, 39, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1):
        pieces.append(run(ours, cache, ids[start:start + n], [(0, start, n)]))
        start += n
    assert start == len(ids)
    torch.testing.assert_close(torch.cat(pieces), hf_prefill_then_decode(theirs, ids, 80), atol=ATOL, rtol=0)


@torch.no_grad()
def hf_prefill_then_decode(hf_model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """HF's logits as its `generate` computes them: one forward over the first `prefill` tokens, then one
    token at a time over its KV cache (LongRoPE picks its factors per forward)."""
    out = hf_model(ids[None, :prefill], use_cache=True)
    logits, past = [out.logits[0]], out.past_key_values
    for i in range(prefill, len(ids)):
        out = hf_model(ids[None, i:i + 1], past_key_values=past, use_cache=True)
        logits.append(out.logits[0])
        past = out.past_key_values
    return torch.cat(logits).float()


def test_batch_of_prompts_of_different_lengths_in_one_forward(models):
    ours, theirs = models
    prompts = [prompt(n, seed=10 + n) for n in (5, 30, 1, 17)]
    logits = run(ours, PagedCache(ours.spec, len(prompts), 32), torch.cat(prompts),
                 [(i, 0, len(p)) for i, p in enumerate(prompts)])
    torch.testing.assert_close(logits, torch.cat([hf_logits(theirs, p) for p in prompts]), atol=ATOL, rtol=0)


# ---- the engine's greedy outputs, float32 on the CPU ------------------------------------------------------
def generate_all(path: Path, **engine_args) -> tuple[list[list[int]], dict]:
    with LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, **engine_args) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.stats()
        llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs], stats


def comparable_lengths(checkpoint) -> list[int]:
    """How many generated tokens of each prompt HF's `generate` and pagednb must agree on: all, except after
    a Phi-3 sequence outgrows its pretraining length: there `generate` recomputes the whole cache with the
    long factors, while pagednb keeps each token's K (rotary._longrope); the logits tests check what follows."""
    name, path = checkpoint
    if name != "phi3":
        return [MAX_NEW] * len(PROMPTS)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    lengths = [min(MAX_NEW, PHI3_PRETRAINED_LEN - len(tok(p).input_ids) + 1) for p in PROMPTS]
    assert min(lengths) < MAX_NEW  # one sequence does cross
    return lengths


def assert_greedy_equal(checkpoint, got: list[list[int]], refs: list[list[int]]) -> None:
    lengths = comparable_lengths(checkpoint)
    assert [list(g[:n]) for g, n in zip(got, lengths)] == [r[:n] for r, n in zip(refs, lengths)]


def test_engine_matches_hf_with_chunked_prefill(checkpoint, references):
    got, stats = generate_all(checkpoint[1], num_kv_blocks=64, max_num_batched_tokens=7)
    assert_greedy_equal(checkpoint, got, references)
    assert stats["used_blocks"] == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_matches_hf_with_preemption(checkpoint, references, async_scheduling):
    """The smallest pool the engine accepts (one request of max_model_len; sliding layers need fewer), with
    asynchronous scheduling too (a GPU's default; on a CPU it is off unless asked): then the next step is
    scheduled, and may preempt, before this one's tokens are known."""
    with LLM(str(checkpoint[1]), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64) as llm:
        smallest = llm.engine.pool_plan.blocks_per_max_request
    got, stats = generate_all(checkpoint[1], num_kv_blocks=smallest, max_num_batched_tokens=16,
                              async_scheduling=async_scheduling)
    assert_greedy_equal(checkpoint, got, references)
    assert stats["preemptions"] > 0


def test_engine_matches_hf_with_prefix_cache_hits(checkpoint, references):
    name, path = checkpoint
    with LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN) as llm:
        first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        hits = llm.stats()["prefix_cache_hit_tokens"]
    assert_greedy_equal(checkpoint, [o.outputs[0].token_ids for o in first], references)
    assert_greedy_equal(checkpoint, [o.outputs[0].token_ids for o in second], references)
    if name not in SLIDING:  # (whether windowed models cache prefixes is the KV cache manager's call)
        assert hits > 0


# ---- the same on a GPU -----------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not CUDA, reason=GPU_REASON)


@gpu
def test_gpu_float32_kernels_match_hf(checkpoint, references):
    """What "auto" picks on a GPU, the CUDA backend (Gemma 2's soft-capping in the row kernel, windows shorter
    than a block, chunked prefill, the fused norms and RoPE, CUDA graphs), against HF's eager attention on the
    CPU (hf_references)."""
    path, refs = checkpoint[1], references
    with LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN,
             max_num_batched_tokens=16) as llm:
        assert llm.engine.device.type == "cuda" and llm.engine.attention_backend.name == "cuda"
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_greedy_equal(checkpoint, [o.outputs[0].token_ids for o in outs], refs)


@gpu
@torch.no_grad()
def test_gpu_bfloat16_matches_hf_except_near_ties(checkpoint):
    """bf16 on the tensor-core prefill and the decode kernels, CUDA graphs on. Where a continuation leaves
    HF's, HF's own logits there must nearly tie between its token and ours (a few bf16 steps apart)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = checkpoint[1]
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").to("cuda").eval()
    with LLM(str(path), dtype="bfloat16", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN,
             max_num_batched_tokens=16) as llm:
        assert llm.engine.attention_backend.name == "cuda"
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    exact = 0
    for text, out, n in zip(PROMPTS, outs, comparable_lengths(checkpoint)):
        ids = tok(text).input_ids
        ref = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=MAX_NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()[:n]
        got = list(out.outputs[0].token_ids)[:n]
        if got == ref:
            exact += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(got, ref)) if a != b)
        logits = hf(torch.tensor([ids + got[:i]], device="cuda")).logits[0, -1].float()
        assert logits[ref[i]] - logits[got[i]] <= 0.1, (text, i, got, ref)
    assert exact >= len(PROMPTS) // 2  # near-ties are the exception


# ---- bfloat16 rounding points, on the CPU ---------------------------------------------------------------
@pytest.mark.parametrize("style, hf_norm", [("float32", "olmo2.modeling_olmo2.Olmo2RMSNorm"),
                                            ("gemma", "gemma3.modeling_gemma3.Gemma3RMSNorm"),
                                            ("llama", "llama.modeling_llama.LlamaRMSNorm")])
def test_norm_styles_round_as_hf_in_bfloat16(style, hf_norm):
    """Bit for bit: in float32 the styles agree, in bf16 each rounds where its HF model does."""
    import importlib

    from pagednb.model.layers import RMSNorm
    module, cls = hf_norm.rsplit(".", 1)
    theirs = getattr(importlib.import_module(f"transformers.models.{module}"), cls)(256, eps=1e-6)
    ours = RMSNorm(256, 1e-6, style)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(256, generator=gen) * 0.5
    with torch.no_grad():
        theirs.weight.copy_(weight)
        ours.weight.copy_(weight)
    theirs, ours = theirs.to(torch.bfloat16), ours.to(torch.bfloat16)
    x, residual = (torch.randn(8, 256, generator=gen).to(torch.bfloat16) * 3 for _ in range(2))
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
        out, stream = ours(x, residual)
        assert torch.equal(stream, x + residual) and torch.equal(out, theirs(x + residual))


def test_gemma_embedding_scale_is_rounded_to_the_model_dtype_as_hf_does():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from pagednb.model.layers import ScaledEmbedding
    hidden = 1152  # Gemma-3-1B: sqrt(1152) = 33.94 is 34.0 in bfloat16
    theirs = Gemma3TextScaledWordEmbedding(10, hidden, 0, embed_scale=hidden ** 0.5).to(torch.bfloat16)
    ours = ScaledEmbedding(10, hidden, hidden ** 0.5, scale_in_model_dtype=True).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
    ids = torch.arange(10)
    assert torch.equal(ours(ids), theirs(ids))
    ours.scale_in_model_dtype = False  # the unrounded scale gives other values
    assert not torch.equal(ours(ids), theirs(ids))


@torch.no_grad()
def test_gemma2_oracle_keeps_the_attention_soft_cap(tmp_path):
    """The tiny Gemma 2's soft-cap changes HF's greedy outputs, and the references keep it: an oracle that
    dropped it (transformers 5.17's "sdpa" default for Gemma 2) made the correct kernels look wrong (issue 15)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_model(tmp_path, "gemma2")
    tok = AutoTokenizer.from_pretrained(path)
    uncapped = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                    attn_logit_softcapping=None).eval()
    first_tokens = [int(uncapped(tok(p, return_tensors="pt").input_ids).logits[0, -1].argmax()) for p in PROMPTS]
    refs = hf_references(path)
    assert sum(ref[0] != first for ref, first in zip(refs, first_tokens)) >= len(PROMPTS) // 2
