"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral layers: a router picks each token's top-k
experts, and the token's output is their gated MLPs' outputs weighted by the routing.

The architectures differ only in a few numbers, read here from the HF config into a MoeConfig: how many
experts, how many per token, whether the top-k weights are renormalised (Qwen3-MoE: norm_topk_prob;
Mixtral: always) and rounded to the model dtype (Qwen3-MoE) or kept in float32 (Mixtral), and which layers
are sparse (Qwen3-MoE: decoder_sparse_step and mlp_only_layers; the others keep the dense GatedMLP).

The experts are stored stacked (w13 [E, 2 * I, H]: gate rows then up rows; w2 [E, H, I]) so that one
fused_moe call (fused_moe.py: the CUDA kernel, or the torch reference) runs them all. Checkpoints spell
them in three ways, all accepted (`checkpoint_tensors` rewrites the others into the first):
  * per expert, Qwen3-MoE's Hub layout and what transformers 5 save_pretrained writes:
    `mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight`;
  * per expert, Mixtral's: `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`
    (w1 = gate, w3 = up, w2 = down);
  * stacked, transformers 5's in-memory layout: `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pagednb.model.fused_moe import fused_moe, select_experts
from pagednb.model.small_linear import Linear
from pagednb.validation import as_int


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    renormalize: bool  # divide the top-k weights by their sum
    weights_in_logits_dtype: bool  # round the routing weights to the model dtype (Qwen3-MoE) or keep float32
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or the dense GatedMLP


def qwen3_moe(cfg) -> MoeConfig:
    """Qwen3-MoE: layer i is sparse unless listed in mlp_only_layers or (i + 1) is not a multiple of
    decoder_sparse_step (HF's Qwen3MoeDecoderLayer)."""
    experts = _count("num_experts", cfg.num_experts, 0)
    step = _count("decoder_sparse_step", getattr(cfg, "decoder_sparse_step", 1), 1)
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers))
    return _moe_config(cfg, experts, "moe_intermediate_size", bool(getattr(cfg, "norm_topk_prob", False)),
                       True, sparse)


def mixtral_moe(cfg) -> MoeConfig:
    """Mixtral: every layer sparse, experts of intermediate_size, top-k weights renormalised in float32."""
    experts = _count("num_local_experts", cfg.num_local_experts, 1)
    return _moe_config(cfg, experts, "intermediate_size", True, False, (True,) * cfg.num_hidden_layers)


def _moe_config(cfg, experts: int, inter_field: str, renormalize: bool, round_weights: bool,
                sparse: tuple[bool, ...]) -> MoeConfig:
    inter = _count(inter_field, getattr(cfg, inter_field, None), 1)
    top_k = _count("num_experts_per_tok", cfg.num_experts_per_tok, 1)
    if any(sparse) and top_k > experts:
        raise ValueError(f"model config num_experts_per_tok ({top_k}) must be at most the number of experts "
                         f"({experts}): each token picks that many distinct experts")
    return MoeConfig(experts, top_k, inter, renormalize, round_weights, sparse)


def _count(name: str, value, minimum: int) -> int:
    return as_int(f"model config {name}", value, f"an int >= {minimum}", minimum)


class FusedExperts(nn.Module):
    """E gated MLPs stacked: w13 [E, 2 * I, H] (gate rows, then up rows) and w2 [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def weight_targets(self, prefix: str) -> dict[str, tuple[torch.Tensor, tuple]]:
        """Checkpoint name (per-expert layout) -> (parameter, the part of it that tensor fills)."""
        inter = self.intermediate_size
        targets = {}
        for e in range(self.w13.shape[0]):
            targets[f"{prefix}.{e}.gate_proj.weight"] = (self.w13, (e, slice(0, inter)))
            targets[f"{prefix}.{e}.up_proj.weight"] = (self.w13, (e, slice(inter, 2 * inter)))
            targets[f"{prefix}.{e}.down_proj.weight"] = (self.w2, (e,))
        return targets


class SparseMoeBlock(nn.Module):
    """Router (`gate`, no bias) and experts; forward: the routed, weighted sum of the experts' outputs."""

    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = FusedExperts(moe.num_experts, hidden_size, moe.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.moe.top_k, self.moe.renormalize,
                                      self.moe.weights_in_logits_dtype)
        return fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)


# ---- checkpoint names ---------------------------------------------------------------------------------------
_MIXTRAL_EXPERT = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensor under pagednb's names (FusedExperts.weight_targets): Mixtral's names rewritten,
    a stacked tensor split into per-expert views (no copy); any other tensor passes as it is."""
    if match := _MIXTRAL_EXPERT.match(name):
        prefix, expert, which = match.groups()
        yield f"{prefix}.mlp.experts.{expert}.{_MIXTRAL_NAMES[which]}.weight", tensor
    elif ".block_sparse_moe.gate." in name:
        yield name.replace(".block_sparse_moe.gate.", ".mlp.gate."), tensor
    elif (match := _STACKED.match(name)) and tensor.dim() == 3:
        prefix, which = match.groups()
        if which == "down_proj":
            for e, w in enumerate(tensor):
                yield f"{prefix}.{e}.down_proj.weight", w
        else:
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
    else:
        yield name, tensor
