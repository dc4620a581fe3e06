"""Building blocks shared by the decoder models: RMSNorm, fused linears, the gated MLP."""
from __future__ import annotations

import torch
from torch import nn

from pagednb.model.fused_ops import rms_norm, silu_and_mul
from pagednb.model.small_linear import Linear


class RMSNorm(nn.Module):
    """RMSNorm with HF's numerics: normalise in float32, cast back, then scale by the weight.

    Called with a residual it first adds it (in the model dtype, as HF does) and returns the sum as
    the new residual, which saves one pass over the hidden states per norm. On a GPU the add and the
    norm are one kernel (fused_ops.rms_norm).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


class MergedLinear(Linear):
    """Several linears sharing one input, stored as one matrix so a step runs one matmul.

    `shards` names the original (HF) projections in output order, e.g. {"q_proj": 512, ...}; the
    loader uses it to place each checkpoint tensor in its rows.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)

    def shard_slices(self) -> dict[str, slice]:
        """Output rows owned by each original projection."""
        slices, start = {}, 0
        for name, size in self.shards.items():
            slices[name] = slice(start, start + size)
            start += size
        return slices

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a forward output back into the original projections' outputs."""
        return out.split(list(self.shards.values()), dim=-1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one projection (and, on a GPU, silu and
    the product into one kernel)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
