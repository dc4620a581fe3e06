"""pagednb's own decoder for the dense architectures it runs (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3,
OLMo 2, Granite) over the paged KV cache.

They are one transformer that differs in a few switches: where the norms sit (before each block, before
and after it, or only after it), how a norm rounds its weight, q/k norms, biases, the MLP's activation,
multipliers on the embeddings, the residual branches, the attention scores and the logits, soft-capping,
and which RoPE each layer uses. A DecoderFlavor names the switches, and the registry (registry.py) says
which flavour each architecture gets. Parameter names mirror HF's, so checkpoints load by name; q/k/v and
gate/up are fused (see layers.MergedLinear).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from pagednb.attention.backend import AttentionBackend, AttentionMetadata, RopeInputs
from pagednb.model.fused_ops import fused_ops_enabled, qk_norm_rope, qk_norm_rope_write_kv
from pagednb.model.layers import GatedMLP, MergedLinear, RMSNorm, ScaledEmbedding
from pagednb.model.moe import MoeConfig, SparseMoeBlock, mixtral_moe, qwen3_moe
from pagednb.model.rotary import RotaryEmbedding
from pagednb.model.small_linear import Linear, NormedInput, linear
from pagednb.model.spec import ModelSpec

# Where each layer has RMSNorms, by HF parameter name, in the order (before attention, after attention,
# before the MLP, after the MLP). Llama's "post_attention_layernorm" is the norm before its MLP.
LAYER_NORMS = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),  # Llama and most others
    "sandwich": ("input_layernorm", "post_attention_layernorm",  # Gemma 2/3: around each block
                 "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),  # OLMo 2
}


@dataclass(frozen=True)
class DecoderFlavor:
    """Where the supported architectures differ from plain Llama (the defaults)."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str | None = None  # "per_head" (Qwen3, Gemma 3) or "full_width" (OLMo 2: over all heads at once)
    layer_norms: str = "pre"  # a key of LAYER_NORMS
    norm_style: str = "llama"  # how every RMSNorm applies its weight (layers.NORM_STYLES)
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh" (Gemma)
    embedding_scale: float = 1.0  # Gemma: sqrt(hidden_size); Granite: embedding_multiplier
    embedding_scale_in_model_dtype: bool = False  # Gemma rounds the scale to the model dtype first
    residual_scale: float = 1.0  # Granite: residual_multiplier, on each block's output
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attention_softcap: float | None = None  # Gemma 2: attn_logit_softcapping
    logits_softcap: float | None = None  # Gemma: final_logit_softcapping
    logits_divisor: float = 1.0  # Granite: logits_scaling
    rope_by_layer_type: bool = False  # Gemma 3: sliding and full layers rotate with different RoPE
    fused_in_checkpoint: bool = False  # Phi-3: the checkpoint stores qkv_proj and gate_up_proj fused
    moe: MoeConfig | None = None  # Qwen3-MoE, Mixtral: sparse MoE MLPs in the layers it marks (moe.py)


def llama_flavor(cfg) -> DecoderFlavor:
    """Llama/Mistral: biases only where the config asks for them."""
    return DecoderFlavor(**_biases(cfg))


def qwen2_flavor(cfg) -> DecoderFlavor:
    """Qwen2: q/k/v biases always, none elsewhere."""
    return DecoderFlavor(qkv_bias=True)


def qwen3_flavor(cfg) -> DecoderFlavor:
    """Qwen3: q/k norm; attention biases only where the config asks for them."""
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return DecoderFlavor(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm="per_head")


def qwen3_moe_flavor(cfg) -> DecoderFlavor:
    """Qwen3-MoE: Qwen3's attention, sparse MoE MLPs where decoder_sparse_step / mlp_only_layers say."""
    return replace(qwen3_flavor(cfg), moe=qwen3_moe(cfg))


def mixtral_flavor(cfg) -> DecoderFlavor:
    """Mixtral: Mistral's attention, a sparse MoE MLP in every layer."""
    return replace(llama_flavor(cfg), moe=mixtral_moe(cfg))


def gemma2_flavor(cfg) -> DecoderFlavor:
    """Gemma 2: the Gemma sandwich, with soft-capped attention scores."""
    return DecoderFlavor(**_gemma(cfg), attention_softcap=getattr(cfg, "attn_logit_softcapping", None))


def gemma3_flavor(cfg) -> DecoderFlavor:
    """Gemma 3: the Gemma sandwich with per-head q/k norms and a RoPE per layer type. Its config may carry
    attn_logit_softcapping, but HF's Gemma 3 attention ignores it, and so does pagednb."""
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("model config use_bidirectional_attention=True (an embedding model) is not supported: "
                         "pagednb runs causal decoders only")
    return DecoderFlavor(**_gemma(cfg), qk_norm="per_head", rope_by_layer_type=True)


def phi3_flavor(cfg) -> DecoderFlavor:
    """Phi-3/Phi-4-mini: Llama's numerics, fused projections in the checkpoint (partial rotary and LongRoPE
    come with its rope parameters)."""
    return DecoderFlavor(fused_in_checkpoint=True, activation=_activation(cfg, "hidden_act"))


def olmo2_flavor(cfg) -> DecoderFlavor:
    """OLMo 2: norms after each block only, q/k norms over the whole projection, weights applied in float32."""
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return DecoderFlavor(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm="full_width", layer_norms="post",
                         norm_style="float32", activation=_activation(cfg, "hidden_act"))


def granite_flavor(cfg) -> DecoderFlavor:
    """Granite: Llama with multipliers on the embeddings, the residual branches, the attention scores (in
    place of 1/sqrt(head_dim)) and the logits (divided)."""
    return DecoderFlavor(**_biases(cfg), activation=_activation(cfg, "hidden_act"),
                         embedding_scale=float(cfg.embedding_multiplier), residual_scale=float(cfg.residual_multiplier),
                         attention_scale=float(cfg.attention_multiplier), logits_divisor=float(cfg.logits_scaling))


def _biases(cfg) -> dict:
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return dict(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))


def _gemma(cfg) -> dict:
    """What Gemma 2 and 3 share: (1 + w) norms around each block, GELU-tanh, sqrt(hidden)-scaled embeddings,
    query_pre_attn_scalar, soft-capped logits."""
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return dict(qkv_bias=attention_bias, o_bias=attention_bias, layer_norms="sandwich", norm_style="gemma",
                activation=_activation(cfg, "hidden_activation"), embedding_scale=cfg.hidden_size ** 0.5,
                embedding_scale_in_model_dtype=True, attention_scale=cfg.query_pre_attn_scalar ** -0.5,
                logits_softcap=getattr(cfg, "final_logit_softcapping", None))


_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF name -> GatedMLP's


def _activation(cfg, field: str) -> str:
    name = getattr(cfg, field, None) or "silu"
    if name not in _ACTIVATIONS:
        raise ValueError(f"model config {field}={name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, cfg, layer: int, flavor: DecoderFlavor,
                 backend: AttentionBackend) -> None:
        super().__init__()
        h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.qkv_proj = MergedLinear(
            spec.hidden_size, {"q_proj": h * d, "k_proj": hkv * d, "v_proj": hkv * d},
            bias=flavor.qkv_bias, fused_in_checkpoint=flavor.fused_in_checkpoint)
        self.o_proj = Linear(h * d, spec.hidden_size, bias=flavor.o_bias)
        self.qk_norm = flavor.qk_norm
        if flavor.qk_norm is not None:
            q_width, k_width = (d, d) if flavor.qk_norm == "per_head" else (h * d, hkv * d)
            self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps, flavor.norm_style)
            self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps, flavor.norm_style)
        self.backend = backend
        self.scale = flavor.attention_scale if flavor.attention_scale is not None else d ** -0.5
        self.softcap = flavor.attention_softcap
        self.sliding_window = spec.sliding_windows[layer]
        # an fp8 KV cache stores K / k_scale and V / v_scale (attention/kv_quant.py): 1.0 unless the checkpoint
        # carries the layer's scales (model/kv_scales.py); plain floats, so CUDA graphs capture them as arguments
        self.k_scale = self.v_scale = 1.0

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor | NormedInput,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.qk_norm == "full_width":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        per_head = self.qk_norm == "per_head"
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if per_head else (None, None, 1e-6)
        offset = self.q_norm.weight_offset if per_head else None
        kv_scales = (self.k_scale, self.v_scale)
        attention = (self.scale, self.sliding_window, self.softcap, *kv_scales)
        # where the fused ops run and the backend can (a decode-only step on the kernel that fuses): the norm,
        # the rotary embedding and the cache write inside the attention launch
        out = (self.backend.attend_rope(q, k, v, kv_cache, metadata, *attention, RopeInputs(*rope, *norm, offset))
               if fused_ops_enabled(q, k, v, *norm[:2]) else None)
        if out is None:
            # on a GPU with pagednb's kernels: one launch, in place in the qkv output, that also writes the
            # step's K/V into the cache; otherwise (or with partial rotary) the ops one by one and the backend's
            # own cache write
            fused = (qk_norm_rope_write_kv(q, k, v, *rope, *norm, kv_cache, metadata.slot_mapping,
                                           weight_offset=offset, kv_scales=kv_scales)
                     if self.backend.name == "cuda" else None)
            if fused is not None:
                q, k = fused
            else:
                q, k = qk_norm_rope(q, k, *rope, *norm, weight_offset=offset)
                self.backend.write_kv(k, v, kv_cache, metadata.slot_mapping, *kv_scales)
            out = self.backend.attend(q, kv_cache, metadata, *attention)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Attention and MLP blocks on a residual stream kept as (hidden, residual): the stream is their sum,
    added inside the next norm (one pass over the hidden states fewer)."""

    def __init__(self, spec: ModelSpec, cfg, layer: int, flavor: DecoderFlavor,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(spec, cfg, layer, flavor, backend)
        if flavor.moe is not None and flavor.moe.sparse_layers[layer]:
            self.mlp = SparseMoeBlock(spec.hidden_size, flavor.moe)
        else:
            self.mlp = GatedMLP(spec.hidden_size, cfg.intermediate_size, bias=flavor.mlp_bias,
                                activation=flavor.activation, fused_in_checkpoint=flavor.fused_in_checkpoint)
        norms = []
        for name in LAYER_NORMS[flavor.layer_norms]:
            if name is not None:
                setattr(self, name, RMSNorm(spec.hidden_size, cfg.rms_norm_eps, flavor.norm_style))
            norms.append(getattr(self, name) if name is not None else None)
        self.norms = tuple(norms)  # (pre-attention, post-attention, pre-MLP, post-MLP); None: absent
        self.residual_scale = flavor.residual_scale

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        pre_attn, post_attn, pre_mlp, post_mlp = self.norms
        x = _block_input(pre_attn, hidden, residual)
        hidden = self._block_output(post_attn, self.self_attn(rope, x, kv_cache, metadata))
        x = _block_input(pre_mlp, hidden, _stream(x))
        out = self.mlp(x if isinstance(self.mlp, GatedMLP) else _materialised(x))  # (the MoE block takes tensors)
        return self._block_output(post_mlp, out), _stream(x)

    def _block_output(self, norm: RMSNorm | None, out: torch.Tensor) -> torch.Tensor:
        """What a block adds to the stream: its output, normed where the layer has a post-norm, scaled
        where the model has a residual multiplier."""
        if norm is not None:
            out = norm(out)
        return out * self.residual_scale if self.residual_scale != 1.0 else out


def _block_input(norm: RMSNorm | None, hidden: torch.Tensor, residual: torch.Tensor | None
                 ) -> torch.Tensor | NormedInput:
    """The block's input: where the layer has a pre-norm, the stream hidden + residual normed, as a NormedInput
    that the block's first projection computes (at 1-2 rows on a GPU inside its GEMV: one launch fewer) and
    that then holds the stream; without one, the stream itself."""
    if norm is not None:
        return norm.deferred(hidden, residual)
    return hidden if residual is None else hidden + residual


def _stream(x: torch.Tensor | NormedInput) -> torch.Tensor:
    """The stream hidden + residual, once the block has taken its input x."""
    return x.stream if isinstance(x, NormedInput) else x


def _materialised(x: torch.Tensor | NormedInput) -> torch.Tensor:
    """x as a tensor, for a block that takes no NormedInput."""
    return x.materialise() if isinstance(x, NormedInput) else x


class DecoderModel(nn.Module):
    """The `model.` part of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, spec: ModelSpec, cfg, flavor: DecoderFlavor,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = ScaledEmbedding(spec.vocab_size, spec.hidden_size, flavor.embedding_scale,
                                            flavor.embedding_scale_in_model_dtype)
        # one RoPE table per distinct layer type (one for most models), and each layer's index into them
        layer_types = list(cfg.layer_types) if flavor.rope_by_layer_type else [None] * spec.num_layers
        rope_types = list(dict.fromkeys(layer_types))
        self.rotary_embs = nn.ModuleList(RotaryEmbedding(cfg, spec.head_dim, t) for t in rope_types)
        self.rope_of_layer = [rope_types.index(t) for t in layer_types]
        self.layers = nn.ModuleList(
            DecoderLayer(spec, cfg, i, flavor, backend)
            for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, cfg.rms_norm_eps, flavor.norm_style)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        ropes = [rotary_emb(positions, hidden.dtype) for rotary_emb in self.rotary_embs]
        layer_metadata = metadata.per_layer(len(self.layers))  # each layer's KV cache group (hybrid models)
        for layer, rope, kv_cache, md in zip(self.layers, self.rope_of_layer, kv_caches, layer_metadata, strict=True):
            hidden, residual = layer(ropes[rope], hidden, residual, kv_cache, md)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def reset_rope_tables(self) -> None:
        for rotary_emb in self.rotary_embs:
            rotary_emb.reset_cache(self.embed_tokens.weight.device)


class CausalLM(nn.Module):
    """Decoder plus LM head. forward returns hidden states; compute_logits only for rows sampled."""

    def __init__(self, spec: ModelSpec, hf_config, flavor: DecoderFlavor,
                 attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = DecoderModel(spec, hf_config, flavor, attn_backend)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.logits_softcap = flavor.logits_softcap
        self.logits_divisor = flavor.logits_divisor
        self.logits_gather = None  # tensor parallel: the ranks' vocabulary blocks joined (distributed/)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype, as HF's LM head rounds them. The sampler reads bf16/fp16 logits as
        they are where its kernel serves the rows and converts them to float32 (exactly) otherwise, so no
        step pays a separate conversion pass over [n, V]. Granite's divisor and Gemma's soft-cap follow, in
        HF's order of operations."""
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        logits = linear(hidden, weight)
        if self.logits_gather is not None:
            logits = self.logits_gather(logits)
        if self.logits_divisor != 1.0:
            logits = logits / self.logits_divisor
        if self.logits_softcap:
            logits = torch.tanh(logits / self.logits_softcap) * self.logits_softcap
        return logits

    def reset_buffers(self) -> None:
        """Recompute non-checkpoint buffers (the RoPE tables) after building on the meta device."""
        self.model.reset_rope_tables()
