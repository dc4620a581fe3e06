"""Megatron-style tensor parallelism for pagednb's one decoder: which rank holds which rows of each
weight, and the collectives that make the shards compute the whole model.

  * column-parallel (each rank a block of output rows; no communication): the merged q/k/v projection
    (each rank its q heads and their kv heads; kv heads replicated when there are fewer than ranks) and
    the merged gate/up projection, and each MoE expert's gate/up rows;
  * row-parallel (each rank a block of input columns, partial sums added up by an all-reduce): o_proj,
    down_proj, and each MoE expert's down projection (one all-reduce for the whole MoE block);
  * vocab-parallel: the embedding (each rank a block of the vocabulary; a token outside it looks up
    zeros, and an all-reduce adds the one rank's row) and the LM head (each rank the logits of its
    block, all-gathered).
OLMo 2's q/k norms span all heads: the shards are gathered, normed whole, and each rank keeps its part.

`shard_model` rewrites a model built on the meta device in place (same parameter names, smaller
shapes), before any memory is allocated, and records on each sharded module `tp_rules`: for each
checkpoint tensor it loads (keyed as the loader names it relative to the module), the rows this rank
keeps (ShardRule). The loader applies them (model/loader.py), and random dummy weights go through the
same rules (dummy_checkpoint), so every load format gives each rank the slice of the tp=1 model.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from pagednb.distributed.process_group import TensorParallelGroup
from pagednb.model.layers import GatedMLP, MergedLinear, RMSNorm, ScaledEmbedding
from pagednb.model.moe import SparseMoeBlock
from pagednb.model.registry import SUPPORTED_ARCHITECTURES
from pagednb.model.small_linear import Linear, linear
from pagednb.model.spec import ModelSpec


@dataclass(frozen=True)
class ShardRule:
    """This rank's part of a checkpoint tensor: the entries `index` along `dim`."""

    dim: int
    index: torch.Tensor  # int64, checkpoint coordinates

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.index_select(self.dim, self.index.to(tensor.device))


# ---- the rules: which rows a rank holds -----------------------------------------------------------------
def check_tensor_parallel(spec: ModelSpec, hf_config, world_size: int) -> None:
    """ValueError naming the model field when the model cannot be split over world_size ranks."""
    if world_size == 1:
        return
    h, kv = spec.num_heads, spec.num_kv_heads
    if h % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's num_attention_heads ({h})")
    if kv % world_size and world_size % kv:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's num_key_value_heads ({kv}) "
                         f"or be a multiple of it (kv heads are then replicated)")
    flavor = SUPPORTED_ARCHITECTURES[spec.architecture].flavor(hf_config)
    moe = flavor.moe
    if moe is not None and any(moe.sparse_layers) and moe.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the experts' intermediate size "
                         f"({moe.intermediate_size})")
    if (moe is None or not all(moe.sparse_layers)) and hf_config.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's intermediate_size "
                         f"({hf_config.intermediate_size})")


def kv_heads_of(rank: int, num_kv_heads: int, world_size: int) -> range:
    """The kv heads a rank holds: its block of them, or the one its query heads read (replicated)."""
    if num_kv_heads >= world_size:
        per_rank = num_kv_heads // world_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (world_size // num_kv_heads)
    return range(head, head + 1)


def shard_spec(spec: ModelSpec, world_size: int) -> ModelSpec:
    """One rank's view of the model: its heads (it allocates its KV pool by it) and its share of the weights."""
    return replace(spec, num_heads=spec.num_heads // world_size,
                   num_kv_heads=len(kv_heads_of(0, spec.num_kv_heads, world_size)),
                   num_parameters=-(-spec.num_parameters // world_size))


def _rows(start: int, stop: int) -> torch.Tensor:
    """Checkpoint indices, on the host (shard_model runs under torch.device("meta"))."""
    return torch.arange(start, stop, device="cpu")


def _block(rank: int, size: int) -> torch.Tensor:
    return _rows(rank * size, (rank + 1) * size)


def _head_rows(heads: range, head_dim: int) -> torch.Tensor:
    return _rows(heads.start * head_dim, heads.stop * head_dim)


# ---- the parallel modules ---------------------------------------------------------------------------------
class RowParallelLinear(Linear):
    """A linear over this rank's input columns; the ranks' partial outputs are summed, then the bias added."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(linear(x, self.weight))
        return out + self.bias if self.bias is not None else out


class _MaskedLookup(nn.Embedding):
    """This rank's block of the vocabulary [start, start + rows); other tokens look up zeros here, and the
    all-reduce adds the row of the one rank that holds them (exact: every other term is zero)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))


class VocabParallelEmbedding(ScaledEmbedding, _MaskedLookup):
    """ScaledEmbedding over a vocabulary block: its forward scales what _MaskedLookup (next in the method
    order, in nn.Embedding's place) returns, so the scale is applied after the all-reduce, as at tp=1."""

    def __init__(self, rows: int, embedding_dim: int, start: int, scale: float, scale_in_model_dtype: bool,
                 tp: TensorParallelGroup) -> None:
        super().__init__(rows, embedding_dim, scale, scale_in_model_dtype)
        self.start, self.tp = start, tp


class ParallelSparseMoeBlock(SparseMoeBlock):
    """The router on every rank (replicated), each expert's intermediate rows split; one all-reduce."""

    def __init__(self, hidden_size: int, moe, tp: TensorParallelGroup) -> None:
        super().__init__(hidden_size, moe)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class GatheredRMSNorm(RMSNorm):
    """An RMSNorm over all ranks' shards at once (OLMo 2's q/k norms span every head): gather the shards,
    norm the whole, keep this rank's part. Its weight is laid out as the gather is (rank 0's rows, ...)."""

    def __init__(self, local_dim: int, eps: float, style: str, tp: TensorParallelGroup) -> None:
        super().__init__(local_dim * tp.world_size, eps, style)
        self.local_dim, self.tp = local_dim, tp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        start = self.tp.rank * self.local_dim
        return super().forward(self.tp.all_gather_last_dim(x))[..., start:start + self.local_dim]


class VocabGather:
    """The LM head's logits of every vocabulary block, gathered on every rank (the sampler runs on rank 0)."""

    def __init__(self, vocab_size: int, tp: TensorParallelGroup) -> None:
        self.vocab_size, self.rows, self.tp = vocab_size, -(-vocab_size // tp.world_size), tp

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] < self.rows:  # the last block of a vocabulary the ranks do not divide
            logits = F.pad(logits, (0, self.rows - logits.shape[-1]))
        gathered = self.tp.all_gather_last_dim(logits)
        return gathered if gathered.shape[-1] == self.vocab_size else gathered[..., :self.vocab_size].contiguous()


# ---- rewriting a model --------------------------------------------------------------------------------------
def shard_model(model: nn.Module, tp: TensorParallelGroup) -> None:
    """Replaces every layer by this rank's shard of it, in place; the model must be on the meta device."""
    spec, n = model.spec, tp.world_size
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, spec, tp)
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp = _sharded_moe(layer.mlp, spec.hidden_size, tp)
        else:
            _shard_mlp(layer.mlp, spec.hidden_size, tp)
    _shard_vocab(model, tp)
    model.spec = shard_spec(spec, n)


def _shard_attention(attn: nn.Module, spec: ModelSpec, tp: TensorParallelGroup) -> None:
    d, r, n = spec.head_dim, tp.rank, tp.world_size
    q_heads = range(r * spec.num_heads // n, (r + 1) * spec.num_heads // n)
    kv_heads = kv_heads_of(r, spec.num_kv_heads, n)
    q_rows, kv_rows = _head_rows(q_heads, d), _head_rows(kv_heads, d)
    qkv = attn.qkv_proj
    attn.qkv_proj = _merged(qkv, {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows})
    o = attn.o_proj
    attn.o_proj = RowParallelLinear(len(q_rows), o.out_features, o.bias is not None, tp)
    attn.o_proj.tp_rules = {"weight": ShardRule(1, q_rows)}
    attn.num_heads, attn.num_kv_heads = len(q_heads), len(kv_heads)
    if attn.qk_norm == "full_width":
        all_kv = torch.cat([_head_rows(kv_heads_of(i, spec.num_kv_heads, n), d) for i in range(n)])
        for name, rows, gathered in (("q_norm", q_rows, _rows(0, spec.num_heads * d)), ("k_norm", kv_rows, all_kv)):
            norm = getattr(attn, name)
            sharded = GatheredRMSNorm(len(rows), norm.eps, _style(norm), tp)
            sharded.tp_rules = {"weight": ShardRule(0, gathered)}
            setattr(attn, name, sharded)


def _shard_mlp(mlp: GatedMLP, hidden_size: int, tp: TensorParallelGroup) -> None:
    inter = mlp.down_proj.in_features // tp.world_size
    rows = _block(tp.rank, inter)
    mlp.gate_up_proj = _merged(mlp.gate_up_proj, {"gate_proj": rows, "up_proj": rows})
    has_bias = mlp.down_proj.bias is not None
    mlp.down_proj = RowParallelLinear(inter, hidden_size, has_bias, tp)
    mlp.down_proj.tp_rules = {"weight": ShardRule(1, rows)}


def _sharded_moe(block: SparseMoeBlock, hidden_size: int, tp: TensorParallelGroup) -> ParallelSparseMoeBlock:
    inter = block.moe.intermediate_size // tp.world_size
    rows = _block(tp.rank, inter)
    sharded = ParallelSparseMoeBlock(hidden_size, replace(block.moe, intermediate_size=inter), tp)
    sharded.experts.tp_rules = {"gate_proj.weight": ShardRule(0, rows), "up_proj.weight": ShardRule(0, rows),
                                "down_proj.weight": ShardRule(1, rows)}
    return sharded


def _merged(full: MergedLinear, rows: dict[str, torch.Tensor]) -> MergedLinear:
    """A column-parallel MergedLinear keeping `rows` of each projection (in checkpoint coordinates). A
    checkpoint storing the projections fused (Phi-3) is cut by one rule over the fused rows."""
    sharded = MergedLinear(full.in_features, {name: len(r) for name, r in rows.items()}, bias=full.bias is not None,
                           fused_in_checkpoint=full.fused_in_checkpoint)
    params = ("weight", "bias") if full.bias is not None else ("weight",)
    if full.fused_in_checkpoint:
        offsets = {name: sum(list(full.shards.values())[:i]) for i, name in enumerate(full.shards)}
        fused = torch.cat([r + offsets[name] for name, r in rows.items()])
        sharded.tp_rules = {p: ShardRule(0, fused) for p in params}
    else:
        sharded.tp_rules = {f"{name}.{p}": ShardRule(0, r) for name, r in rows.items() for p in params}
    return sharded


def _shard_vocab(model: nn.Module, tp: TensorParallelGroup) -> None:
    vocab, hidden = model.spec.vocab_size, model.spec.hidden_size
    per_rank = -(-vocab // tp.world_size)
    start = min(tp.rank * per_rank, vocab)
    rows = _rows(start, min(start + per_rank, vocab))
    embed = model.model.embed_tokens
    model.model.embed_tokens = VocabParallelEmbedding(len(rows), hidden, start, embed.scale,
                                                      embed.scale_in_model_dtype, tp)
    model.model.embed_tokens.tp_rules = {"weight": ShardRule(0, rows)}
    if not model.tie_word_embeddings:
        model.lm_head = Linear(hidden, len(rows), bias=False)
        model.lm_head.tp_rules = {"weight": ShardRule(0, rows)}
    model.logits_gather = VocabGather(vocab, tp)


def _style(norm: RMSNorm) -> str:
    return {None: "llama", 0.0: "float32", 1.0: "gemma"}[norm.weight_offset]


# ---- dummy weights ------------------------------------------------------------------------------------------
@torch.no_grad()
def dummy_checkpoint(full_model: nn.Module, targets: dict, device: torch.device, dtype: torch.dtype,
                     seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint of the tp=1 model's random weights (loader.init_dummy_weights: same seed, same order,
    same values), one parameter at a time, so each rank loads its slice of exactly those weights.
    full_model: the unsharded model on the meta device; targets: its loader.weight_targets."""
    by_param: dict[int, list[tuple[str, object]]] = {}
    for name, (param, part, _) in targets.items():
        by_param.setdefault(id(param), []).append((name, part))
    gen = torch.Generator(device).manual_seed(seed)
    for name, param in full_model.named_parameters():
        values = torch.empty(param.shape, dtype=dtype, device=device)
        if param.dim() >= 2:
            values.normal_(0.0, 0.02, generator=gen)
        else:
            values.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        for target, part in by_param.get(id(param), ()):
            yield target, values if part is None else values[part]
