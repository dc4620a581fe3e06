"""Preallocated buffers for a step's inputs: filled on the host, copied to the GPU in two transfers.

Building a handful of small tensors per step from Python lists costs a dozen allocations and as many
pageable (synchronous) copies. Instead every integer input lives in one of two buffers allocated once,
pinned on the host and mirrored on the device: int64 (token ids, positions, slots, logits rows) and
int32 (query start offsets, sequence lengths, block tables). A step writes the host side through numpy
views, then one asynchronous copy per buffer moves exactly the bytes it used.

The layout is packed by (tokens n, sequences s, block-table width w), so the same (n, s, w) always gives
the same device addresses: a CUDA graph captured for a batch size reads its inputs from where the next
step with that size writes them. On a CPU the host buffers are the device buffers. A hybrid model
(engine/kv_cache_groups.py) has a slot mapping and a block table per layer group, stacked: group 0's are
the plain fields, so a uniform model (one group) has exactly the layout it always had.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StepViews:
    """Host (numpy) and device (torch) views of one step's inputs; index i of each pair aliases."""

    host_input_ids: np.ndarray
    host_positions: np.ndarray
    host_slots: np.ndarray
    host_logits_indices: np.ndarray
    host_query_start_loc: np.ndarray
    host_seq_lens: np.ndarray
    host_block_tables: np.ndarray  # [s, w]
    # a hybrid model's per-group slots and tables, group 0's aliasing the plain fields; None with one group
    host_group_slots: np.ndarray | None  # [groups, n]
    host_group_block_tables: np.ndarray | None  # [groups, s, w]
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor  # [s, w]
    group_slot_mapping: torch.Tensor | None  # [groups, n]
    group_block_tables: torch.Tensor | None  # [groups, s, w]
    num_i64: int
    num_i32: int


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 num_groups: int = 1) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks_per_seq
        self.device = device
        self.num_groups = g = num_groups
        on_gpu = device.type == "cuda"
        self.host_i64 = torch.zeros((2 + g) * max_tokens + max_seqs, dtype=torch.int64, pin_memory=on_gpu)
        self.host_i32 = torch.zeros(2 * max_seqs + 1 + g * max_seqs * max_blocks_per_seq, dtype=torch.int32,
                                    pin_memory=on_gpu)
        self.np_i64, self.np_i32 = self.host_i64.numpy(), self.host_i32.numpy()
        self.dev_i64 = self.host_i64.to(device) if on_gpu else self.host_i64
        self.dev_i32 = self.host_i32.to(device) if on_gpu else self.host_i32
        # The copies of the last upload; the host side is rewritten only after they finish.
        self._uploaded = torch.cuda.Event() if on_gpu else None

    def views(self, n: int, s: int, w: int, num_logits: int) -> StepViews:
        """Views for n tokens, s sequences, block tables w wide, num_logits rows of logits (the sampled rows,
        or more: an eager step pads them to a bucket, model_runner.py).

        Waits for the previous upload first: a step that sampled nothing never synchronised with the GPU,
        so its copies may still be reading the host buffers.
        """
        if not (n <= self.max_tokens and s <= self.max_seqs and w <= self.max_blocks and num_logits <= self.max_seqs):
            raise ValueError(f"step of {n} tokens, {s} sequences, {w} blocks wide, {num_logits} rows of logits "
                             f"exceeds the buffers ({self.max_tokens} tokens, {self.max_seqs} rows, "
                             f"{self.max_blocks} blocks)")
        if self._uploaded is not None:
            self._uploaded.synchronize()
        # int64: ids [0, n), positions [n, 2n), slots [2n, (2 + g)n), logits rows [(2 + g)n, + num_logits);
        # int32: query starts [0, s + 1), lengths [s + 1, 2s + 1), tables [2s + 1, 2s + 1 + g * s * w)
        g = self.num_groups
        s64, t32 = (2 + g) * n, 2 * s + 1 + s * w
        e64, e32 = s64 + num_logits, 2 * s + 1 + g * s * w
        h64, h32, d64, d32 = self.np_i64, self.np_i32, self.dev_i64, self.dev_i32
        grouped = g > 1
        return StepViews(
            h64[:n], h64[n:2 * n], h64[2 * n:3 * n], h64[s64:e64],
            h32[:s + 1], h32[s + 1:2 * s + 1], h32[2 * s + 1:t32].reshape(s, w),
            h64[2 * n:s64].reshape(g, n) if grouped else None,
            h32[2 * s + 1:e32].reshape(g, s, w) if grouped else None,
            d64[:n], d64[n:2 * n], d64[2 * n:3 * n], d64[s64:e64],
            d32[:s + 1], d32[s + 1:2 * s + 1], d32[2 * s + 1:t32].view(s, w),
            d64[2 * n:s64].view(g, n) if grouped else None,
            d32[2 * s + 1:e32].view(g, s, w) if grouped else None,
            num_i64=e64, num_i32=e32,
        )

    def upload(self, views: StepViews) -> None:
        """Copies the used prefix of both host buffers to the device (asynchronously)."""
        if self._uploaded is None:
            return
        self.dev_i64[:views.num_i64].copy_(self.host_i64[:views.num_i64], non_blocking=True)
        self.dev_i32[:views.num_i32].copy_(self.host_i32[:views.num_i32], non_blocking=True)
        self._uploaded.record()
