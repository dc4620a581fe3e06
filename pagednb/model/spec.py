"""ModelSpec: the few numbers about a model that the engine (cache sizing, attention) needs.

It is read once from the HF config (registry.model_spec builds it) so the rest of pagednb never has to
know how each architecture spells its fields (head_dim, num_key_value_heads, sliding-window flags, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
    def from_hf_config(cls, cfg, architecture: str, sliding_windows: tuple[int | None, ...]) -> ModelSpec:
        """The fields every supported architecture spells alike; what differs per architecture (the
        layers' sliding windows) comes from its registry entry."""
        num_heads = cfg.num_attention_heads
        return cls(
            architecture=architecture,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            sliding_windows=sliding_windows,
        )
