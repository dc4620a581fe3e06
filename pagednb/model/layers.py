"""Building blocks shared by the decoder models: RMSNorm, fused linears, the gated MLP."""
from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from pagednb.model.fused_ops import GATES, rms_norm
from pagednb.model.small_linear import Linear, NormedInput, linear_gate_and_mul

# How an RMSNorm applies its weight w to the float32-normalised h; each rounds where its HF model does
# (in float32 all three agree up to Gemma's offset):
#   "llama"   w * h.to(dtype)                 Llama, Qwen, Mistral, Phi-3, Granite
#   "float32" (w.float() * h).to(dtype)       OLMo 2
#   "gemma"   (h * (1 + w.float())).to(dtype) Gemma 2/3: the checkpoint stores w - 1
# Folding Gemma's 1 into a bf16 weight would round 1 + w to 8 bits; keeping w and adding in float32 is
# HF's arithmetic exactly. All three run in the fused kernel on a GPU (fused_ops.rms_norm).
NORM_WEIGHT_OFFSETS = {"float32": 0.0, "gemma": 1.0}
NORM_STYLES = ("llama", *NORM_WEIGHT_OFFSETS)


class RMSNorm(nn.Module):
    """RMSNorm with HF's numerics: normalise in float32, then apply the weight as `style` says.

    Called with a residual it first adds it (in the model dtype, as HF does) and returns the sum as
    the new residual, which saves one pass over the hidden states per norm. On a GPU the add and the
    norm are one kernel (fused_ops.rms_norm).
    """

    def __init__(self, dim: int, eps: float = 1e-6, style: str = "llama") -> None:
        super().__init__()
        if style not in NORM_STYLES:
            raise ValueError(f"RMSNorm style {style!r} is not one of {', '.join(NORM_STYLES)}")
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_offset = NORM_WEIGHT_OFFSETS.get(style)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual, self.weight_offset)

    def deferred(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> NormedInput:
        """forward(x, residual), left to the projection that takes it (at 1-2 rows on a GPU, inside its GEMV)."""
        return NormedInput(x, residual, self.weight, self.eps, self.weight_offset)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times a constant: Granite's embedding_multiplier, or Gemma's sqrt(hidden_size),
    which HF rounds to the model dtype first (sqrt(1152) = 33.94 becomes 34.0 in bfloat16)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float = 1.0,
                 scale_in_model_dtype: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale, self.scale_in_model_dtype = scale, scale_in_model_dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().forward(input_ids)
        if self.scale == 1.0:
            return hidden
        return hidden * (_rounded(self.scale, hidden.dtype) if self.scale_in_model_dtype else self.scale)


@lru_cache(maxsize=None)
def _rounded(value: float, dtype: torch.dtype) -> float:
    return torch.tensor(value, dtype=dtype).item()


class MergedLinear(Linear):
    """Several linears sharing one input, stored as one matrix so a step runs one matmul.

    `shards` names the original (HF) projections in output order, e.g. {"q_proj": 512, ...}; the
    loader uses it to place each checkpoint tensor in its rows, or, fused_in_checkpoint (Phi-3's
    qkv_proj and gate_up_proj), loads the checkpoint's fused tensor of the same name whole.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False,
                 fused_in_checkpoint: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)
        self.fused_in_checkpoint = fused_in_checkpoint

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
    """down(act(gate(x)) * up(x)) with gate and up fused into one projection. act is SiLU or Gemma's
    tanh-approximated GELU; on a GPU the activation and the product are one kernel, or at 1-2 rows part of
    the gate/up projection's GEMV."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, activation: str = "silu",
                 fused_in_checkpoint: bool = False) -> None:
        super().__init__()
        if activation not in GATES:
            raise ValueError(f"GatedMLP activation {activation!r} is not one of {', '.join(GATES)}")
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias=bias,
            fused_in_checkpoint=fused_in_checkpoint)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.gate = GATES[activation]  # the activation's kernel code

    def forward(self, x: torch.Tensor | NormedInput) -> torch.Tensor:
        return self.down_proj(linear_gate_and_mul(x, self.gate_up_proj.weight, self.gate_up_proj.bias, self.gate))
