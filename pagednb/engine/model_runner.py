"""Turns a scheduled step into tensors, runs the model over the paged cache, and samples.

The KV cache is allocated here once, one tensor per layer of shape
[2, num_blocks, block_size, num_kv_heads, head_dim]; in a model mixing sliding-window and full layers,
one tensor per position within a layer group, shared by the groups, and a block table per group
(engine/kv_cache_groups.py). Step inputs are written into preallocated buffers
(step_buffers.py); a step of decode tokens only replays a CUDA graph when one was captured for its
batch size (cuda_graphs.py), any other step runs the model eagerly. Either way the sampler runs on the
device and the sampled tokens come back in the step's one host synchronisation, with them the sampler's
per-row flag (INVALID_TOKEN_ID where a row's logits had no valid distribution): no extra sync.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import compress

import numpy as np
import torch

from pagednb.attention.backend import AttentionMetadata
from pagednb.engine.block_table import BlockTable
from pagednb.engine.cuda_graphs import DecodeGraphs
from pagednb.engine.kv_cache_groups import plan_kv_cache_layout
from pagednb.engine.logits_processors import LogitsProcessors, PendingBitmask
from pagednb.engine.logprobs import compute_prompt_logprobs
from pagednb.engine.sampler import PinnedStager, Sampler, SamplerOutput, SamplingMetadata
from pagednb.engine.scheduler import SchedulerOutput
from pagednb.engine.spec_decode.verify_rows import split_verify_rows
from pagednb.engine.step_buffers import StepBuffers, StepViews
from pagednb.request import Request


@dataclass
class DeferredSampling:
    """What a launched step's sampling needs once its grammar rows' bitmask is filled (structured output:
    the matchers first take the previous step's tokens, which with asynchronous scheduling reach the host
    only after this step's forward was launched)."""

    logits: torch.Tensor
    sampling: SamplingMetadata
    reqs: list[Request]  # the sampled rows' requests
    grammar_rows: list[int]
    prompt_logprobs: object
    bitmask: PendingBitmask | None = None  # started once the matchers are up to date


@dataclass
class LaunchedStep:
    """A step queued on the device: its sampled tokens arrive when collected (None: nothing sampled).

    On a GPU the tokens are copied into pinned memory right behind the sampler and `ready` marks that
    copy's completion: waiting on it waits for this step only, never for a step launched after it (a
    plain device-to-host copy would queue behind that one).
    """

    sampler_output: SamplerOutput | None
    host_token_ids: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    deferred: DeferredSampling | None = None  # set while its sampling waits for grammar rows
    error: Exception | None = None  # its deferred sampling failed: collecting it raises this

    @property
    def token_ids(self) -> torch.Tensor | None:
        return None if self.sampler_output is None else self.sampler_output.token_ids


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, block_size: int,
                 max_num_seqs: int, max_model_len: int, eos_token_ids: list[int],
                 generator: torch.Generator | None = None, max_num_batched_tokens: int = 8192,
                 kv_cache_dtype: torch.dtype | None = None, max_num_draft_rows: int = 0) -> None:
        self.model = model
        self.spec = model.spec
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype  # float8_e4m3fn: an fp8 cache (attention/kv_quant.py)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.generator = generator  # for random rows without a seed of their own
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.layout = plan_kv_cache_layout(self.spec.sliding_windows)
        self.hybrid = self.layout.is_hybrid
        num_groups = len(self.layout.groups)
        self.block_table = BlockTable(max_num_seqs, self.max_blocks_per_seq, num_groups)
        # a step never has more tokens than the budget, nor more sequences than max_num_seqs plus its
        # drafts' verify rows (spec_decode/verify_rows.py); a decode graph pads its batch up to a bucket
        # size, which is never above max_num_seqs
        max_rows = max_num_seqs + max_num_draft_rows
        self.buffers = StepBuffers(max(max_num_batched_tokens, max_num_seqs), max_rows,
                                   self.max_blocks_per_seq, device, num_groups)
        self.stager = PinnedStager(device)
        self._aranges = np.arange(max_num_seqs + 1, dtype=np.int32)
        self._identity = list(range(max_num_seqs + max_num_draft_rows))  # pending rows taken in place
        self.sampler = Sampler()
        self.logits_processors: LogitsProcessors | None = None  # set by the engine
        self.kv_caches: list[torch.Tensor] = []  # per layer (a hybrid model's layers share tensors)
        self.kv_cache_tensors: list[torch.Tensor] = []  # each tensor once: what the cache holds in memory
        self.graphs: DecodeGraphs | None = None
        self.tensor_parallel = None  # the ranks this runner's model is a shard of (distributed/), None on one device
        # the last launch's sampled tokens (device) and each sampling request's index among them
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self._deferred: LaunchedStep | None = None  # the launched step whose sampling waits (DeferredSampling)
        # pinned landing places of the sampled tokens, one per step that may be in flight (+1 spare)
        on_gpu = device.type == "cuda"
        self._host_tokens = [torch.empty(max_rows, dtype=torch.int64, pin_memory=on_gpu) for _ in range(3)]
        self._tokens_ready = [torch.cuda.Event() if on_gpu else None for _ in range(3)]
        self._token_slot = 0
        # that copy runs on a stream of its own: the next step's uploads and forward then queue behind the
        # sampler only, not behind a device-to-host copy too (a batch-1 step is a chain of such launches)
        self._copy_stream = torch.cuda.Stream(device) if on_gpu else None

    # ---- memory ----------------------------------------------------------------------------------
    def block_bytes(self) -> int:
        """Bytes of one block id: block_size tokens of the layers it spans (every layer, or one group's)."""
        per_layer = self.spec.kv_bytes_per_token(self.kv_cache_dtype) // self.spec.num_layers
        return per_layer * self.layout.layers_per_block * self.block_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        # Zeroed, not empty: a reference backend reads whole blocks and masks the unused slots, and
        # a NaN bit pattern left in never-written memory would survive a zero attention weight.
        self.kv_cache_tensors = [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                                 for _ in range(self.layout.layers_per_block)]
        self.kv_caches = [self.kv_cache_tensors[j] for j in self.layout.layer_tensor]

    def release_kv_cache(self) -> None:
        self.graphs = None  # the graphs hold the caches' addresses
        self.kv_caches.clear()  # in place: a traceback's frame may still hold the lists
        self.kv_cache_tensors.clear()

    def forget_last_sampled(self) -> None:
        """Drops the last launch's device tensor of sampled tokens (sleep mode: nothing will read it)."""
        self._last_sampled = None

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_model_len: int) -> int:
        """Runs a forward pass of num_tokens dummy tokens; returns the bytes of its scratch KV cache."""
        seq_lens = [min(max_model_len, num_tokens - i) for i in range(0, num_tokens, max_model_len)]
        blocks_per_seq = [-(-n // self.block_size) for n in seq_lens]
        self.allocate_kv_cache(sum(blocks_per_seq))
        tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
        first = 0
        for i, n in enumerate(blocks_per_seq):
            tables[i, :n] = torch.arange(first, first + n)
            first += n
        positions = torch.cat([torch.arange(n) for n in seq_lens])
        slots = torch.cat([tables[i, torch.arange(n) // self.block_size] * self.block_size
                           + torch.arange(n) % self.block_size for i, n in enumerate(seq_lens)])
        qsl = [0] + np.cumsum(seq_lens).tolist()
        metadata = AttentionMetadata(
            slot_mapping=slots.to(self.device), query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device), block_tables=tables.to(self.device),
            max_query_len=max(seq_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
        hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=self.device),
                            positions.to(self.device), self.kv_caches, metadata)
        self.model.compute_logits(hidden[torch.tensor(qsl[1:], device=self.device) - 1]).float()  # the sampler's copy
        scratch = sum(t.numel() * t.element_size() for t in self.kv_cache_tensors)
        self.release_kv_cache()
        return scratch

    def capture_decode_graphs(self, max_batch_size: int, progress: bool = True) -> None:
        """Captures the decode forward at each bucket size up to max_batch_size (the KV cache must exist)."""
        self.graphs = DecodeGraphs(DecodeGraphs.bucket_sizes(max_batch_size))
        self.graphs.capture(self._padded_decode_forward, self.device, progress)

    def release_requests(self, request_ids: list[str]) -> None:
        """Forgets the rows of requests that left the running set (finished, aborted, preempted)."""
        for request_id in request_ids:
            self.block_table.release(request_id)

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        """Queues the step's forward pass and sampling on the device; returns without waiting for them.
        A step with grammar rows queues its sampling later (DeferredSampling): at the next launch, right before
        that step's inputs read its tokens, or when it is collected.

        A decode-only step replays the CUDA graph of its batch size; others run eagerly. Inputs whose
        token was sampled by the previous launch and is not known here yet (Request.num_pending_tokens)
        are copied from that launch's device tensor.
        """
        self.stager.next_step()
        self._sample_deferred()  # the previous step's, before this step's inputs read its tokens
        graph_size = self.graphs.size_for(sched) if self.graphs is not None else None
        prompt_logprobs = None  # (a step with prompt rows is never a decode-only graph step)
        if graph_size is not None:
            sampled_reqs = self._fill_decode(sched, graph_size)
            logits = self.graphs.replay(graph_size)[:len(sampled_reqs)]
        else:
            inputs, sampled_reqs = self.prepare_inputs(sched)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
            if sched.wants_prompt_logprobs:
                prompt_logprobs = compute_prompt_logprobs(self.model, hidden, sched)
            if not sampled_reqs:
                return LaunchedStep(None if prompt_logprobs is None else SamplerOutput(
                    torch.empty(0, dtype=torch.int64), None, None, None, prompt_logprobs=prompt_logprobs))
            logits = self.model.compute_logits(hidden[inputs.logits_indices])[:len(sampled_reqs)]
        # built while the GPU runs the forward; its tensors travel through pinned memory, so nothing
        # here waits for the device
        sampling = SamplingMetadata.build(
            [r.sampling_params for r in sampled_reqs], [r.generator for r in sampled_reqs],
            [r.prompt_token_ids for r in sampled_reqs], [r.output_token_ids for r in sampled_reqs],
            vocab_size=logits.shape[-1], device=self.device, eos_token_ids=self.eos_token_ids,
            generator=self.generator, stager=self.stager)
        processors = self.logits_processors
        if processors is not None and processors.active:
            sampling.adjustments = processors.build(sampled_reqs, logits.shape[-1], self.device, self.stager)
        launched = LaunchedStep(None)
        grammar_rows = processors.grammar_rows(sampled_reqs) if processors is not None else []
        if grammar_rows:  # sampled at the next launch or collect, once the matchers caught up
            launched.deferred = DeferredSampling(logits, sampling, sampled_reqs, grammar_rows, prompt_logprobs)
            self._deferred = launched
        else:
            self._sample(launched, logits, sampling, sampled_reqs, prompt_logprobs)
        return launched

    def _sample(self, launched: LaunchedStep, logits: torch.Tensor, sampling: SamplingMetadata,
                sampled_reqs: list[Request], prompt_logprobs) -> None:
        """Queues the sampler and the copy of its tokens to the host behind the step's forward."""
        result = self.sampler(logits, sampling)
        result.prompt_logprobs = prompt_logprobs
        self._last_sampled = (result.token_ids, {r.request_id: i for i, r in enumerate(sampled_reqs)})
        launched.sampler_output = result
        if self.device.type == "cuda":
            slot = self._token_slot = (self._token_slot + 1) % len(self._host_tokens)
            host, ready = self._host_tokens[slot], self._tokens_ready[slot]
            ready.synchronize()  # its previous step was collected long ago; this never waits in practice
            launched.host_token_ids = host[:len(sampled_reqs)]
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                launched.host_token_ids.copy_(result.token_ids, non_blocking=True)
                ready.record()
            result.token_ids.record_stream(self._copy_stream)  # its memory is not reused before the copy read it
            launched.ready = ready

    def start_grammar_fill(self, launched: LaunchedStep) -> None:
        """Called once the matchers have every token sampled before `launched` (the engine processed the steps
        before it): its grammar rows start filling on the grammar thread while the host goes on."""
        deferred = launched.deferred
        if deferred is not None and deferred.bitmask is None:
            deferred.bitmask = self.logits_processors.start_grammar_bitmask(
                deferred.reqs, deferred.grammar_rows, self.device, background=True)

    def finish_sampling(self, launched: LaunchedStep) -> None:
        """Queues `launched`'s deferred sampling now if it still waits (its tokens are about to be read)."""
        if launched is self._deferred:
            self._sample_deferred()

    @torch.inference_mode()
    def _sample_deferred(self) -> None:
        """Queues the deferred step's sampling with its grammar bitmask (filled here if nothing started it).
        A failure is kept for that step's collect, so its requests alone end with it; the next step's inputs
        read placeholder tokens for its rows meanwhile."""
        launched, self._deferred = self._deferred, None
        if launched is None:
            return
        deferred, launched.deferred = launched.deferred, None
        processors = self.logits_processors
        try:
            if deferred.bitmask is None:
                deferred.bitmask = processors.start_grammar_bitmask(deferred.reqs, deferred.grammar_rows, self.device,
                                                                    background=False)
            deferred.sampling.grammar_bitmask = processors.finish_grammar_bitmask(deferred.bitmask, self.device)
            self._sample(launched, deferred.logits, deferred.sampling, deferred.reqs, deferred.prompt_logprobs)
        except Exception as error:
            launched.error = error
            placeholders = torch.zeros(len(deferred.reqs), dtype=torch.int64, device=self.device)
            self._last_sampled = (placeholders, {r.request_id: i for i, r in enumerate(deferred.reqs)})

    def collect(self, launched: LaunchedStep) -> tuple[list[int], SamplerOutput | None]:
        """Waits for a launched step; its sampled tokens, one per sampling request in schedule order
        (INVALID_TOKEN_ID for a row the sampler flagged: the scheduler ends that request alone)."""
        self.finish_sampling(launched)
        if launched.error is not None:
            raise launched.error
        if launched.token_ids is None:
            return [], None
        if launched.ready is None:
            return launched.token_ids.tolist(), launched.sampler_output
        launched.ready.synchronize()
        return launched.host_token_ids.tolist(), launched.sampler_output

    # ---- step inputs ---------------------------------------------------------------------------
    def _update_block_table(self, sched: SchedulerOutput) -> None:
        block_table = self.block_table
        if self.hybrid:  # new_block_ids: one list per group, or [] when no group got a block
            for s in sched.scheduled:
                if s.is_new:
                    block_table.start_groups(s.request.request_id, s.new_block_ids)
                elif s.new_block_ids:
                    block_table.append_groups(s.request.request_id, s.new_block_ids)
            return
        for s in sched.scheduled:
            if s.is_new:
                block_table.start(s.request.request_id, s.new_block_ids)
            elif s.new_block_ids:
                block_table.append(s.request.request_id, s.new_block_ids)

    def _gather_rows(self, sched: SchedulerOutput
                     ) -> tuple[list[Request], list[int], list[int], list[int], list[int], list[int]]:
        """The one pass over a step's requests that both kinds of step share: the requests, their
        tokens flattened, each one's first position and block-table row, and which tokens are still on
        the device (their index among the tokens, where a placeholder 0 stands, and their index among
        the previous launch's sampled tokens). Only a one-token row can be pending."""
        self._update_block_table(sched)
        row_of = self.block_table.row_of
        last_index = self._last_sampled[1] if self._last_sampled is not None else {}
        reqs, token_ids, starts, rows, pending_rows, pending_sources = [], [], [], [], [], []
        for s in sched.scheduled:
            req, start = s.request, s.start
            ids = req.all_token_ids
            reqs.append(req)
            starts.append(start)
            rows.append(row_of[req.request_id])
            if start >= len(ids):  # sampled by the previous launch, not known here yet
                pending_rows.append(len(token_ids))
                pending_sources.append(last_index[req.request_id])
                token_ids.append(0)
            elif s.num_new_tokens == 1:
                token_ids.append(ids[start])
            else:
                token_ids += ids[start:start + s.num_new_tokens]
                if s.draft_token_ids:  # the last known token, then the drafts to verify
                    token_ids += s.draft_token_ids
        return reqs, token_ids, starts, rows, pending_rows, pending_sources

    def _write_rows(self, v: StepViews, token_ids: list[int], positions: np.ndarray, token_rows: np.ndarray,
                    rows: np.ndarray, seq_lens: np.ndarray, width: int) -> None:
        """Writes what every step feeds the model into v's leading entries: tokens, their positions and
        cache slots (token_rows: each token's block-table row), and each sequence's length and table."""
        table, block_size = self.block_table.table, self.block_size
        num_tokens, num_seqs = len(positions), len(rows)
        v.host_input_ids[:num_tokens] = token_ids
        v.host_positions[:num_tokens] = positions
        v.host_slots[:num_tokens] = table[token_rows, positions // block_size] * block_size \
            + positions % block_size
        v.host_seq_lens[:num_seqs] = seq_lens
        v.host_block_tables[:num_seqs] = table[rows, :width]
        if self.hybrid:  # the other groups' slots and tables (group 0's are written above)
            tables = self.block_table.tables
            v.host_group_slots[1:, :num_tokens] = tables[1:, token_rows, positions // block_size] * block_size \
                + positions % block_size
            v.host_group_block_tables[1:, :num_seqs] = tables[1:, rows, :width]

    def _upload(self, v: StepViews, pending_rows: list[int], pending_sources: list[int]) -> None:
        """Sends the step's inputs to the device, then fills the pending tokens in there (one gather
        from the previous launch's sampled tokens, no host round trip)."""
        self.buffers.upload(v)
        if pending_rows:
            self._gather_pending(v.input_ids, pending_rows, pending_sources)

    def _gather_pending(self, input_ids: torch.Tensor, rows: list[int], sources: list[int]) -> None:
        """input_ids[rows] = the previous launch's sampled tokens[sources], on the device. A row the sampler
        flagged (INVALID_TOKEN_ID) reads token 0 instead: its request ends with an error when that flag
        reaches the host, this step's token is dropped, and nothing indexes the embedding with -1."""
        token_ids = self._last_sampled[0]
        n = len(rows)
        if rows[-1] == sources[-1] == n - 1 and rows == sources == self._identity[:n]:
            # the usual decode step, the same rows in the same order: one launch instead of two index uploads and
            # three kernels (batch-1 latency is a chain of such launches)
            torch.clamp(token_ids[:n], min=0, out=input_ids[:n])
            return
        input_ids.index_copy_(0, self.stager.tensor(rows, torch.int64),
                              token_ids.index_select(0, self.stager.tensor(sources, torch.int64)).clamp_(min=0))

    def prepare_inputs(self, sched: SchedulerOutput) -> tuple[StepInputs, list[Request]]:
        """A step of any shape (prefill chunks and decode tokens), in buffers sized to it; also the
        requests that sample, in schedule order."""
        scheduled = sched.scheduled
        reqs, token_ids, starts, rows, pending_rows, pending_sources = self._gather_rows(sched)
        sample_mask = [s.samples for s in scheduled]
        sampled_reqs = reqs if all(sample_mask) else list(compress(reqs, sample_mask))
        starts_np = np.array(starts, dtype=np.int64)
        lens_np = np.array([s.num_new_tokens for s in scheduled], dtype=np.int64)
        rows_np = np.array(rows, dtype=np.int64)
        if sched.num_draft_tokens:  # a drafted request's tokens become one-token rows, each with logits
            starts_np, lens_np, rows_np, sample_np, seq_reqs = split_verify_rows(
                scheduled, reqs, starts_np, lens_np, rows_np, np.array(sample_mask))
            sample_mask = sample_np.tolist()
            sampled_reqs = list(compress(seq_reqs, sample_mask))
        qsl = np.zeros(len(lens_np) + 1, dtype=np.int64)
        np.cumsum(lens_np, out=qsl[1:])
        num_tokens = int(qsl[-1])
        seq_lens = starts_np + lens_np
        max_seq_len = int(seq_lens.max())
        width = -(-max_seq_len // self.block_size)
        num_sampled = len(sampled_reqs)
        v = self.buffers.views(num_tokens, len(lens_np), width, self._logits_rows(num_sampled))
        positions = np.repeat(starts_np - qsl[:-1], lens_np) + np.arange(num_tokens)
        self._write_rows(v, token_ids, positions, np.repeat(rows_np, lens_np), rows_np, seq_lens, width)
        v.host_logits_indices[:num_sampled] = qsl[1:][np.array(sample_mask, dtype=bool)] - 1
        v.host_logits_indices[num_sampled:] = num_tokens - 1  # padding rows: computed, never sampled
        v.host_query_start_loc[:] = qsl
        self._upload(v, pending_rows, pending_sources)
        metadata = AttentionMetadata(
            slot_mapping=v.slot_mapping, query_start_loc=v.query_start_loc, seq_lens=v.seq_lens,
            block_tables=v.block_tables, max_query_len=int(lens_np.max()), max_seq_len=max_seq_len,
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist())
        if self.hybrid:
            self._add_layer_metadata(metadata, v)
        return StepInputs(v.input_ids, v.positions, metadata, v.logits_indices), sampled_reqs

    def _logits_rows(self, num_sampled: int) -> int:
        """How many rows an eager step's LM head computes: on a GPU the sampled rows padded to a graph bucket
        size (DecodeGraphs.rows_bucket: few GEMM shapes; the padding rows' logits are never read), elsewhere
        exactly the sampled rows."""
        if self.device.type != "cuda":
            return num_sampled
        return DecodeGraphs.rows_bucket(num_sampled, self.buffers.max_seqs)

    def _fill_decode(self, sched: SchedulerOutput, batch_size: int) -> list[Request]:
        """A decode-only step (one token per row, every row sampling) written into the fixed inputs of
        the graph for batch_size, the rest padded; returns each row's request (a drafted request has
        1 + k rows), all of which sample."""
        reqs, token_ids, starts, rows, pending_rows, pending_sources = self._gather_rows(sched)
        v = self._decode_views(batch_size)
        rows_np, positions = np.array(rows, dtype=np.int64), np.array(starts, dtype=np.int64)
        if sched.num_draft_tokens:  # a drafted request's tokens are rows of their own, each sampling
            ones = np.ones(len(reqs), dtype=np.int64)
            positions, _, rows_np, _, reqs = split_verify_rows(sched.scheduled, reqs, positions, ones, rows_np, ones)
        self._write_rows(v, token_ids, positions, rows_np, rows_np, positions + 1, self.max_blocks_per_seq)
        self._pad_decode_rows(v, len(reqs))
        self._upload(v, pending_rows, pending_sources)
        return reqs

    def _decode_views(self, batch_size: int) -> StepViews:
        """Where a decode step of batch_size rows (padded) keeps its inputs; fixed per batch size."""
        return self.buffers.views(batch_size, batch_size, self.max_blocks_per_seq, batch_size)

    def _pad_decode_rows(self, v: StepViews, num_rows: int) -> None:
        """One sequence per row; rows from num_rows on are padding: one token at position 0 of block 0,
        never written (slot -1), output ignored."""
        v.host_query_start_loc[:] = self._aranges[:len(v.host_query_start_loc)]
        v.host_input_ids[num_rows:] = 0
        v.host_positions[num_rows:] = 0
        v.host_slots[num_rows:] = -1
        v.host_seq_lens[num_rows:] = 1
        v.host_block_tables[num_rows:, 0] = 0
        if self.hybrid:
            v.host_group_slots[1:, num_rows:] = -1
            v.host_group_block_tables[1:, num_rows:, 0] = 0

    def _add_layer_metadata(self, metadata: AttentionMetadata, v: StepViews) -> None:
        """A hybrid model's layers each read their group's slots and block table; the rest is shared."""
        groups = [replace(metadata, slot_mapping=v.group_slot_mapping[g], block_tables=v.group_block_tables[g],
                          base=metadata) for g in range(len(self.layout.groups))]
        metadata.layer_metadata = [groups[g] for g in self.layout.layer_group]

    def _padded_decode_forward(self, batch_size: int) -> Callable[[], torch.Tensor]:
        """For capturing the graph of batch_size: every row of its inputs a padding row (uploaded), and
        the forward over them to the logits, attention planned for the longest sequence (max_model_len)."""
        v = self._decode_views(batch_size)
        self._pad_decode_rows(v, 0)
        self.buffers.upload(v)
        max_len = self.max_model_len
        metadata = AttentionMetadata(
            slot_mapping=v.slot_mapping, query_start_loc=v.query_start_loc, seq_lens=v.seq_lens,
            block_tables=v.block_tables, max_query_len=1, max_seq_len=max_len,
            query_start_loc_cpu=list(range(batch_size + 1)), seq_lens_cpu=[max_len] * batch_size)
        if self.hybrid:
            self._add_layer_metadata(metadata, v)
        model, kv_caches = self.model, self.kv_caches
        return lambda: model.compute_logits(model(v.input_ids, v.positions, kv_caches, metadata))
