"""Rotary position embeddings with a cos/sin table precomputed for every position.

Frequencies are computed exactly as HF transformers does (float32, same formulas), so a lookup in
the table gives bit-identical cos/sin to HF's on-the-fly computation.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(cfg, layer_type: str | None = None) -> dict:
    """The rope dict of a config: `rope_parameters` (transformers 5) or legacy `rope_scaling`; for one
    layer type where the config keeps one dict per type (Gemma 3: "sliding_attention" layers rotate with a
    local base, "full_attention" layers with rope_theta and the scaling). Fills what HF's functions
    default: the base, the pretraining length, the rotated fraction of each head and the model's length."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    elif layer_type == "sliding_attention" and getattr(cfg, "rope_local_base_freq", None):  # transformers 4 Gemma 3
        params = {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(cfg, "rope_theta", None) or 10000.0
    params.setdefault("original_max_position_embeddings",
                      getattr(cfg, "original_max_position_embeddings", None) or cfg.max_position_embeddings)
    params.setdefault("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0)
    params["max_position_embeddings"] = cfg.max_position_embeddings
    return params


def rotary_dim(params: dict, head_dim: int) -> int:
    """How many leading dims of each head rotate (Phi-4-mini: 3/4 of them); the rest pass through."""
    return int(head_dim * params["partial_rotary_factor"])


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _default(p: dict, dim: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(p["rope_theta"], dim), 1.0


def _linear(p: dict, dim: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(p["rope_theta"], dim) / p["factor"], 1.0


def _llama3(p: dict, dim: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1: keep high frequencies, divide low ones by factor, blend smoothly in between."""
    inv_freq = _base_inv_freq(p["rope_theta"], dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(p: dict, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale cos/sin."""
    base, old_len = p["rope_theta"], p["original_max_position_embeddings"]
    factor = p["factor"]
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                            if mscale and mscale_all else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(p: dict, dim: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE ("su"): per-frequency divisors, short_factor within the pretraining length and
    long_factor beyond it, and cos/sin scaled by sqrt(1 + ln(factor) / ln(pretraining length)).

    HF picks one set per forward pass (long when the pass reaches past the pretraining length), and its
    Phi-3 `generate` drops the KV cache once when a sequence outgrows that length, recomputing every
    token with the long set. A paged cache keeps each token's K as it was computed, so pagednb picks the
    set per position instead: short below the pretraining length, long from it on. That is HF's result
    for every sequence within the pretraining length (Phi-4-mini: 4,096 tokens) and for HF's forward over
    a cache, whatever the chunking, preemption or prefix sharing; past that length HF's recomputed
    sequence differs. Returns per-position frequencies [max_position_embeddings, dim / 2]."""
    old_len = p["original_max_position_embeddings"]
    factor = p.get("factor") or p["max_position_embeddings"] / old_len
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (1.0 / (torch.tensor(p[name], dtype=torch.float32) * p["rope_theta"] ** exponents)
                   for name in ("short_factor", "long_factor"))
    positions = torch.arange(p["max_position_embeddings"])[:, None]
    return torch.where(positions >= old_len, long, short), float(attention_factor)


_ROPE_TYPES = {"default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn, "longrope": _longrope,
               "su": _longrope}


def rope_inv_freq(cfg, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq float32, cos/sin scaling) for the config's rope type (of layer_type's layers): inv_freq is
    [rotary_dim / 2], or [max_position_embeddings, rotary_dim / 2] where it depends on the position."""
    params = rope_parameters(cfg, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: "
                         f"{', '.join(_ROPE_TYPES)}")
    return _ROPE_TYPES[rope_type](params, rotary_dim(params, head_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table of every position up to max_position_embeddings (of one layer type's rope,
    where the config has one per type)."""

    def __init__(self, cfg, head_dim: int, layer_type: str | None = None) -> None:
        super().__init__()
        self.cfg, self.head_dim, self.layer_type = cfg, head_dim, layer_type
        self.register_buffer("cos_sin_cache", self._compute_cache(), persistent=False)

    def _compute_cache(self) -> torch.Tensor:
        """[max_positions, 2, rotary_dim] float32; computed like HF's forward, so values match exactly."""
        inv_freq, scaling = rope_inv_freq(self.cfg, self.head_dim, self.layer_type)
        positions = torch.arange(self.cfg.max_position_embeddings, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return torch.stack((emb.cos() * scaling, emb.sin() * scaling), dim=1)

    def reset_cache(self, device: torch.device | str = "cpu") -> None:
        """Recompute the table (after the module was built on the meta device)."""
        self.cos_sin_cache = self._compute_cache().to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, rotary_dim] for the step's positions; looked up once, used by every layer of the
        type (the fused q/k kernel reads them in place, one row per token, when every dim rotates)."""
        cos_sin = self.cos_sin_cache[positions].to(dtype)
        return cos_sin[:, 0, None], cos_sin[:, 1, None]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [N, H, D] and k [N, Hkv, D] with HF's rotate-half convention; with partial rotary (cos, sin
    narrower than D) only the leading dims rotate and the rest pass through, as HF's Phi-3 does."""
    dim = cos.shape[-1]
    if dim == q.shape[-1]:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    return tuple(torch.cat((x[..., :dim] * cos + _rotate_half(x[..., :dim]) * sin, x[..., dim:]), dim=-1)
                 for x in (q, k))
