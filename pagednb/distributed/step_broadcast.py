"""What rank 0 tells the workers, and how: a fixed-size header per message on the control group, then
the message's payload.

The scheduler runs once, on rank 0. For a step, rank 0 builds the inputs as on one GPU (the model
runner's two step buffers: int64 tokens/positions/slots/logits rows, int32 query starts/lengths/block
tables) and sends the used prefix of both host buffers; a worker receives them into its own step
buffers at the same layout (so a decode step lands where its CUDA graph reads), uploads them, and runs
the same forward. Inputs only rank 0's device knows (tokens sampled by the step still in flight, under
asynchronous scheduling) follow on the device group, straight from rank 0's device buffer. The rows
the LM head reads besides the sampled ones (prompt logprobs) follow when there are any: every rank
must run the LM head over the same rows, since its logits are all-gathered.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from pagednb.distributed.process_group import TensorParallelGroup
from pagednb.engine.step_buffers import StepBuffers, StepViews

HEADER_FIELDS = 8


class Op(IntEnum):
    STEP = 1  # args: tokens, sequences, block-table width, sampled rows, graph size (0: eager), pending, prompt rows
    PROFILE_KV_POOL = 2  # every rank profiles its memory; the pool is what the least of them affords
    ALLOCATE_KV_CACHE = 3  # args: num_blocks
    CAPTURE_GRAPHS = 4  # args: the largest batch size
    SHUTDOWN = 5


@dataclass(frozen=True)
class StepShape:
    """A step's header: enough for a worker to lay out and run it."""

    num_tokens: int
    num_seqs: int
    width: int  # of the block tables
    num_sampled: int
    graph_size: int  # the decode CUDA graph it replays; 0: eager
    has_pending: bool  # input tokens known only on rank 0's device
    num_prompt_rows: int  # LM-head rows for prompt logprobs


def send_op(tp: TensorParallelGroup, op: Op, *args: int) -> None:
    """Rank 0's order to every worker (a header; STEP's payload follows, StepSender.send_step)."""
    header = torch.zeros(HEADER_FIELDS, dtype=torch.int64)
    header[0] = op
    header[1:1 + len(args)] = torch.tensor(args, dtype=torch.int64)
    tp.broadcast_host(header)


class StepSender:
    """Rank 0's side of a step."""

    def __init__(self, tp: TensorParallelGroup, buffers: StepBuffers) -> None:
        self.tp, self.buffers = tp, buffers

    def send_step(self, v: StepViews, graph_size: int, has_pending: bool, prompt_rows: list[int]) -> None:
        """After rank 0 uploaded v (and filled its pending tokens on the device)."""
        n, s, w = len(v.host_input_ids), len(v.host_seq_lens), v.host_block_tables.shape[1]
        send_op(self.tp, Op.STEP, n, s, w, len(v.host_logits_indices), graph_size, int(has_pending),
                len(prompt_rows))
        self.tp.broadcast_host(self.buffers.host_i64[:v.num_i64])
        self.tp.broadcast_host(self.buffers.host_i32[:v.num_i32])
        if prompt_rows:
            self.tp.broadcast_host(torch.tensor(prompt_rows, dtype=torch.int64))
        if has_pending:
            self.tp.broadcast_device(v.input_ids)


class StepReceiver:
    """A worker's side: orders, and each step's inputs."""

    def __init__(self, tp: TensorParallelGroup, buffers: StepBuffers) -> None:
        self.tp, self.buffers = tp, buffers

    def receive_op(self) -> tuple[Op, list[int]]:
        header = torch.zeros(HEADER_FIELDS, dtype=torch.int64)
        self.tp.broadcast_host(header)
        values = header.tolist()
        return Op(values[0]), values[1:]

    def receive_step(self, args: list[int]) -> tuple[StepShape, StepViews, list[int]]:
        """The step's inputs in this worker's buffers, uploaded; and its prompt-logprob rows."""
        shape = StepShape(*args[:4], args[4], bool(args[5]), args[6])
        v = self.buffers.views(shape.num_tokens, shape.num_seqs, shape.width, shape.num_sampled)
        self.tp.broadcast_host(self.buffers.host_i64[:v.num_i64])
        self.tp.broadcast_host(self.buffers.host_i32[:v.num_i32])
        prompt_rows = []
        if shape.num_prompt_rows:
            rows = torch.empty(shape.num_prompt_rows, dtype=torch.int64)
            self.tp.broadcast_host(rows)
            prompt_rows = rows.tolist()
        self.buffers.upload(v)
        if shape.has_pending:
            self.tp.broadcast_device(v.input_ids)
        return shape, v, prompt_rows


def host_lengths(v: StepViews) -> tuple[list[int], list[int], int, int]:
    """(query starts, sequence lengths, longest query, longest sequence) from the host side of v, as
    rank 0's model runner had them when it built the step."""
    qsl = v.host_query_start_loc.tolist()
    seq_lens = v.host_seq_lens.tolist()
    max_query_len = int(np.diff(v.host_query_start_loc).max()) if len(seq_lens) else 0
    return qsl, seq_lens, max_query_len, max(seq_lens, default=0)
