"""pagednb's own Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

The architectures differ only in a few switches (projection biases, per-head q/k norm, sliding
windows), so one implementation serves them all: a DecoderFlavor names the switches, and the registry
(registry.py) says which flavour each architecture gets. Parameter names mirror HF's, except that
q/k/v and gate/up are fused (see layers.MergedLinear).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagednb.attention.backend import AttentionBackend, AttentionMetadata
from pagednb.model.fused_ops import qk_norm_rope, qk_norm_rope_write_kv
from pagednb.model.layers import GatedMLP, MergedLinear, RMSNorm
from pagednb.model.rotary import RotaryEmbedding
from pagednb.model.small_linear import Linear, linear
from pagednb.model.spec import ModelSpec


@dataclass(frozen=True)
class DecoderFlavor:
    """Where the supported architectures differ from plain Llama."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE


def llama_flavor(cfg) -> DecoderFlavor:
    """Llama/Mistral: biases only where the config asks for them."""
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return DecoderFlavor(qkv_bias=attention_bias, o_bias=attention_bias,
                         mlp_bias=bool(getattr(cfg, "mlp_bias", False)))


def qwen2_flavor(cfg) -> DecoderFlavor:
    """Qwen2: q/k/v biases always, none elsewhere."""
    return DecoderFlavor(qkv_bias=True)


def qwen3_flavor(cfg) -> DecoderFlavor:
    """Qwen3: q/k norm; attention biases only where the config asks for them."""
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return DecoderFlavor(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, cfg, layer: int, flavor: DecoderFlavor,
                 backend: AttentionBackend) -> None:
        super().__init__()
        h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.qkv_proj = MergedLinear(
            spec.hidden_size, {"q_proj": h * d, "k_proj": hkv * d, "v_proj": hkv * d},
            bias=flavor.qkv_bias)
        self.o_proj = Linear(h * d, spec.hidden_size, bias=flavor.o_bias)
        if flavor.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = flavor.qk_norm
        self.backend = backend
        self.scale = d ** -0.5
        self.sliding_window = spec.sliding_windows[layer]

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 1e-6)
        # on a GPU with pagednb's kernels: one launch, in place in the qkv output, that also writes the
        # step's K/V into the cache; otherwise the ops one by one and the backend's own cache write
        fused = (qk_norm_rope_write_kv(q, k, v, *rope, *norm, kv_cache, metadata.slot_mapping)
                 if self.backend.name == "cuda" else None)
        if fused is not None:
            q, k = fused
        else:
            q, k = qk_norm_rope(q, k, *rope, *norm)
            self.backend.write_kv(k, v, kv_cache, metadata.slot_mapping)
        out = self.backend.attend(q, kv_cache, metadata, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, cfg, layer: int, flavor: DecoderFlavor,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(spec, cfg, layer, flavor, backend)
        self.mlp = GatedMLP(spec.hidden_size, cfg.intermediate_size, bias=flavor.mlp_bias)
        self.input_layernorm = RMSNorm(spec.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """The `model.` part of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, spec: ModelSpec, cfg, flavor: DecoderFlavor,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg, spec.head_dim)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, cfg, i, flavor, backend)
            for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype, as HF's LM head rounds them. The sampler reads bf16/fp16 logits as
        they are where its kernel serves the rows and converts them to float32 (exactly) otherwise, so no
        step pays a separate conversion pass over [n, V]."""
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return linear(hidden, weight)

    def reset_buffers(self) -> None:
        """Recompute non-checkpoint buffers (the RoPE table) after building on the meta device."""
        self.model.rotary_emb.reset_cache(self.model.embed_tokens.weight.device)

