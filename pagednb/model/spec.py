"""ModelSpec: the few numbers about a model that the engine (cache sizing, attention) needs.

It is read once from the HF config so the rest of pagednb never has to know how each architecture
spells its fields (head_dim, num_key_value_heads, sliding-window flags, ...).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture is not one pagednb implements."""


def _no_windows(cfg) -> tuple[int | None, ...]:
    return (None,) * cfg.num_hidden_layers


def _mistral_windows(cfg) -> tuple[int | None, ...]:
    """Mistral applies its sliding_window (when set) to every layer."""
    return (getattr(cfg, "sliding_window", None),) * cfg.num_hidden_layers


def _qwen_windows(cfg) -> tuple[int | None, ...]:
    """Qwen2/3 slide only when use_sliding_window is on, and only in layers typed so."""
    window = getattr(cfg, "sliding_window", None)
    if not getattr(cfg, "use_sliding_window", False) or window is None:
        return _no_windows(cfg)
    layer_types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


# Per architecture: how its config states which layers use a sliding window.
_WINDOW_RULES: dict[str, Callable[[object], tuple[int | None, ...]]] = {
    "LlamaForCausalLM": _no_windows,
    "MistralForCausalLM": _mistral_windows,
    "Qwen2ForCausalLM": _qwen_windows,
    "Qwen3ForCausalLM": _qwen_windows,
}


def check_architecture(cfg) -> str:
    """The config's architecture name, or UnsupportedArchitectureError listing what is supported."""
    names = getattr(cfg, "architectures", None) or []
    arch = names[0] if names else None
    if arch not in _WINDOW_RULES:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} is not supported by pagednb; "
            f"supported: {', '.join(sorted(_WINDOW_RULES))}")
    return arch


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...]  # one per layer; None = full attention

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers (sizes the block pool)."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @property
    def sliding_window(self) -> int | None:
        """The window when every layer slides by the same window (cache can be bounded), else None."""
        windows = set(self.sliding_windows)
        return windows.pop() if len(windows) == 1 else None

    @classmethod
    def from_hf_config(cls, cfg) -> ModelSpec:
        arch = check_architecture(cfg)
        num_heads = cfg.num_attention_heads
        return cls(
            architecture=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            sliding_windows=_WINDOW_RULES[arch](cfg),
        )
