"""The seam between the model and the paged KV cache: attention metadata and the backend interface.

A step's batch is flattened: the new tokens of every scheduled sequence stand one after another
("varlen"), sequence i owning rows query_start_loc[i]:query_start_loc[i+1]. Each sequence's keys and
values live in the paged cache, reached through its row of block_tables: token t of a sequence sits in
block block_tables[i, t // block_size] at offset t % block_size. A backend first writes the step's new
K/V into their slots (slot_mapping), then attends each query to every cached token of its sequence up
to and including its own position (and, for sliding-window layers, no further back than the window).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step's batch. Built once per step, shared by all layers
    (in a model mixing sliding-window and full layers, each layer reads its group's slots and block
    table: layer_metadata, engine/kv_cache_groups.py)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat slot (block_id * block_size + offset); -1 = skip
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: row offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens in the cache after this step (context + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32; unused entries are arbitrary
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # host copies, so a reference backend never syncs with the device
    seq_lens_cpu: list[int]
    # per layer, the metadata of its KV cache group (same batch, that group's slot_mapping and
    # block_tables); None: every layer reads this one
    layer_metadata: list[AttentionMetadata] | None = field(default=None, repr=False)
    # a layer group's metadata: the step's it was made from (a backend may share its per-step planning)
    base: AttentionMetadata | None = field(default=None, repr=False)

    def per_layer(self, num_layers: int) -> list[AttentionMetadata]:
        return self.layer_metadata if self.layer_metadata is not None else [self] * num_layers

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes attention through the block tables.

    The KV cache of one layer is a tensor of shape [2, num_blocks, block_size, num_kv_heads, head_dim]
    (index 0: keys, 1: values). That layout is what the CUDA kernels read as well.
    """

    name: str = "abstract"

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """key/value: [num_tokens, num_kv_heads, head_dim]; rows whose slot is -1 are not written. An fp8
        cache (float8_e4m3fn) stores fp8(key / k_scale) and fp8(value / v_scale) (attention/kv_quant.py);
        other caches ignore the scales."""

    @abstractmethod
    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, sliding_window: int | None, softcap: float | None = None,
               k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim] -> output of the same shape.

        Query row j of sequence i sits at position p = seq_len_i - query_len_i + (j - start_i) and
        attends to cached tokens t of sequence i with t <= p and, if sliding_window is W, p - t < W
        (the same rule as HF transformers' sliding-window mask). num_heads is a multiple of
        num_kv_heads (GQA): query head h reads kv head h // (num_heads // num_kv_heads). softcap c (Gemma 2's
        attn_logit_softcapping): each scaled score s becomes c * tanh(s / c) before the softmax. An fp8
        cache's keys and values are read as stored * k_scale and stored * v_scale.
        """

    def attend_rope(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, sliding_window: int | None, softcap: float | None,
                    k_scale: float, v_scale: float, rope: RopeInputs) -> torch.Tensor | None:
        """attend() on the raw projections: the step's per-head q/k RMSNorm and rotary embedding (rope) and the
        write of its K/V into the cache happen inside the attention launch (as model/fused_ops.py's
        qk_norm_rope_write_kv would do them, with the same bits). None where the backend cannot do that for this
        step: the caller then runs those ops and attend() itself. query, key and value are left as they are."""
        return None


@dataclass(frozen=True)
class RopeInputs:
    """What the q/k norm and rotary embedding of a step take (model/fused_ops.py's qk_norm_rope): cos, sin rows
    per token ([N, 1, D] or [N, D]); the per-head norm weights [D] (both None: no norm), eps, and weight_offset
    (None: Llama's rounding; a number: the weight plus it in float32)."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
    weight_offset: float | None
