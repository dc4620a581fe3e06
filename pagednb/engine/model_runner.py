"""Turns a scheduled step into tensors, runs the model over the paged cache, and samples.

The KV cache is allocated here once, one tensor per layer of shape
[2, num_blocks, block_size, num_kv_heads, head_dim].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagednb.attention.backend import AttentionMetadata
from pagednb.engine.block_table import BlockTable
from pagednb.engine.sampler import Sampler, SamplerOutput, SamplingMetadata
from pagednb.engine.scheduler import SchedulerOutput


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, block_size: int,
                 max_num_seqs: int, max_model_len: int, eos_token_ids: list[int],
                 generator: torch.Generator | None = None) -> None:
        self.model = model
        self.spec = model.spec
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.generator = generator  # for random rows without a seed of their own
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.block_table = BlockTable(max_num_seqs, self.max_blocks_per_seq)
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []

    # ---- memory ----------------------------------------------------------------------------------
    def block_bytes(self) -> int:
        return self.spec.kv_bytes_per_token(self.dtype) * self.block_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        # Zeroed, not empty: a reference backend reads whole blocks and masks the unused slots, and
        # a NaN bit pattern left in never-written memory would survive a zero attention weight.
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.spec.num_layers)]

    def release_kv_cache(self) -> None:
        self.kv_caches = []

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_model_len: int) -> int:
        """Runs a forward pass of num_tokens dummy tokens; returns the bytes of its scratch KV cache."""
        seq_lens = [min(max_model_len, num_tokens - i) for i in range(0, num_tokens, max_model_len)]
        blocks_per_seq = [-(-n // self.block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq)
        self.allocate_kv_cache(num_blocks)
        tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
        first = 0
        for i, n in enumerate(blocks_per_seq):
            tables[i, :n] = torch.arange(first, first + n)
            first += n
        positions = torch.cat([torch.arange(n) for n in seq_lens])
        slots = torch.cat([tables[i, torch.arange(n) // self.block_size] * self.block_size
                           + torch.arange(n) % self.block_size for i, n in enumerate(seq_lens)])
        qsl = [0] + list(np.cumsum(seq_lens))
        inputs = StepInputs(
            input_ids=torch.zeros(num_tokens, dtype=torch.long, device=self.device),
            positions=positions.to(self.device),
            metadata=self._metadata(slots, qsl, seq_lens, tables, max(seq_lens)),
            logits_indices=torch.tensor(qsl[1:], device=self.device) - 1,
        )
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        self.model.compute_logits(hidden[inputs.logits_indices])
        scratch = sum(t.numel() * t.element_size() for t in self.kv_caches)
        self.release_kv_cache()
        return scratch

    def release_requests(self, request_ids: list[str]) -> None:
        """Forgets the rows of requests that left the running set (finished, aborted, preempted)."""
        for request_id in request_ids:
            self.block_table.release(request_id)

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[int], SamplerOutput]:
        """Runs the scheduled tokens; returns one sampled token per sampling request, in order."""
        inputs, sampled_reqs = self.prepare_inputs(sched)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        if not sampled_reqs:
            return [], None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        sampling = SamplingMetadata.build(
            [r.sampling_params for r in sampled_reqs], [r.generator for r in sampled_reqs],
            [r.prompt_token_ids for r in sampled_reqs], [r.output_token_ids for r in sampled_reqs],
            vocab_size=logits.shape[-1], device=self.device, eos_token_ids=self.eos_token_ids,
            generator=self.generator)
        result = self.sampler(logits, sampling)
        return result.token_ids.tolist(), result

    def prepare_inputs(self, sched: SchedulerOutput) -> tuple[StepInputs, list]:
        """Flattens the step's tokens and gathers positions, slots and block tables (vectorised)."""
        token_ids: list[int] = []
        starts, lens, rows, sampled_reqs, sample_mask = [], [], [], [], []
        block_table, row_of = self.block_table, self.block_table.row_of
        for s in sched.scheduled:
            req, start, n = s.request, s.start, s.num_new_tokens
            if s.is_new:
                block_table.start(req.request_id, s.new_block_ids)
            elif s.new_block_ids:
                block_table.append(req.request_id, s.new_block_ids)
            if n == 1:
                token_ids.append(req.all_token_ids[start])
            else:
                token_ids += req.all_token_ids[start:start + n]
            starts.append(start)
            lens.append(n)
            rows.append(row_of[req.request_id])
            sample_mask.append(s.samples)
            if s.samples:
                sampled_reqs.append(req)
        starts_np, lens_np = np.array(starts, dtype=np.int64), np.array(lens, dtype=np.int64)
        qsl = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens_np, out=qsl[1:])
        num_tokens = int(qsl[-1])
        positions = np.repeat(starts_np - qsl[:-1], lens_np) + np.arange(num_tokens)
        rows_np = np.array(rows, dtype=np.int64)
        table = self.block_table.table
        slots = table[np.repeat(rows_np, lens_np), positions // self.block_size].astype(np.int64) \
            * self.block_size + positions % self.block_size
        seq_lens = starts_np + lens_np
        max_seq_len = int(seq_lens.max())
        tables = table[rows_np, :-(-max_seq_len // self.block_size)]
        logits_indices = qsl[1:][np.array(sample_mask, dtype=bool)] - 1
        inputs = StepInputs(
            input_ids=self._to_device(torch.tensor(token_ids, dtype=torch.long)),
            positions=self._to_device(torch.from_numpy(positions)),
            metadata=self._metadata(torch.from_numpy(slots), qsl.tolist(), seq_lens.tolist(),
                                    torch.from_numpy(np.ascontiguousarray(tables)), int(lens_np.max())),
            logits_indices=self._to_device(torch.from_numpy(logits_indices)),
        )
        return inputs, sampled_reqs

    def _metadata(self, slots: torch.Tensor, qsl: list[int], seq_lens: list[int], tables: torch.Tensor,
                  max_query_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._to_device(slots.long()),
            query_start_loc=self._to_device(torch.tensor(qsl, dtype=torch.int32)),
            seq_lens=self._to_device(torch.tensor(seq_lens, dtype=torch.int32)),
            block_tables=self._to_device(tables.int()),
            max_query_len=max_query_len, max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        )

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)
