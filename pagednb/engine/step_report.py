"""What one engine step decided, and why: the record the step-through debugger shows.

The engine builds a `StepReport` only while a `StepRecorder` is attached (`LLM.on_step`,
`LLM.debug_step`): a step that nobody watches pays one `is None` check. The numbers are derived from
state the engine keeps anyway — the scheduler's output and the pool's counts before and after the
step — so the scheduler and the KV cache manager need no bookkeeping of their own for it; the one
exception is a preemption's reason, which only the scheduler knows when it picks the victim.

With asynchronous scheduling (the GPU default) a step launches its batch and finishes the previous
one: the report describes the batch scheduled in this step; the tokens it samples arrive in the next.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagednb.outputs import RequestOutput
from pagednb.request import Request

if TYPE_CHECKING:  # (these modules import this one)
    from pagednb.engine.block_pool import BlockPool
    from pagednb.engine.kv_cache_manager import KVCacheManager
    from pagednb.engine.llm_engine import LLMEngine
    from pagednb.engine.scheduler import Scheduler, ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class BatchRow:
    """One request's share of the step: tokens [start, start + num_tokens) of its sequence."""

    request_id: str
    kind: str  # "prefill": prompt (or recomputed) tokens, "decode": its next token
    start: int
    num_tokens: int
    num_prompt_tokens: int
    cached_tokens: int  # served by a prefix-cache hit at admission in this step (0 otherwise)
    new_block_ids: tuple[int, ...]  # blocks appended to its table (hit blocks first)
    samples: bool  # reaches the end of its known tokens: the step samples its next token
    admitted: bool  # joined the running set in this step (new, or back after a preemption)
    num_draft_tokens: int = 0  # a decode row's draft tokens verified with it (speculative decoding)


@dataclass(frozen=True)
class Preemption:
    request_id: str
    reason: str  # "out of blocks: request 'b' needed 1 block, 0 free"
    blocks_freed: int


@dataclass(frozen=True)
class PoolCounts:
    free: int
    cached: int  # free blocks still holding reusable prefix content
    used: int


@dataclass(frozen=True)
class StepReport:
    """One step of the engine as the scheduler and the KV cache saw it."""

    step: int  # counted on from the steps the engine had launched when recording began
    rows: tuple[BatchRow, ...]
    num_batched_tokens: int
    max_num_batched_tokens: int
    num_running: int  # after the step
    max_num_seqs: int
    waiting: tuple[str, ...]  # request ids still waiting after the step, in queue order
    waiting_reason: str | None  # why the head of the queue was not admitted (None: nobody waits)
    blocks_allocated: int  # fresh blocks handed out
    blocks_hit: int  # blocks reused from the prefix cache by admissions
    blocks_freed: int  # block references dropped by requests that ended or were preempted
    preemptions: tuple[Preemption, ...]
    finished: tuple[tuple[str, str], ...]  # (request id, finish reason) of requests that ended
    block_tables: dict[str, tuple[int, ...]]  # every request holding blocks after the step
    pool_before: PoolCounts
    pool_after: PoolCounts
    block_size: int
    duration_s: float

    @property
    def num_prefill_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows if row.kind == "prefill")

    @property
    def num_decode_rows(self) -> int:
        return sum(row.kind == "decode" for row in self.rows)

    def summary(self) -> str:
        """'step 3: 2 prefill (40 tokens) + 1 decode = 41 of 2048 tokens, 3 of 256 seqs; blocks +3 (1 hit) -0'"""
        prefill = len(self.rows) - self.num_decode_rows
        text = (f"step {self.step}: {prefill} prefill ({self.num_prefill_tokens} tokens) + "
                f"{self.num_decode_rows} decode = {self.num_batched_tokens} of {self.max_num_batched_tokens} "
                f"tokens, {self.num_running} of {self.max_num_seqs} seqs; blocks +{self.blocks_allocated} "
                f"({self.blocks_hit} hit) -{self.blocks_freed}")
        for p in self.preemptions:
            text += f"; preempted {p.request_id!r} ({p.reason})"
        if self.waiting:
            text += f"; {len(self.waiting)} waiting: {self.waiting_reason}"
        return text


    def __str__(self) -> str:
        """The summary, then one line per batch row, preemption and block table: for print()."""
        lines = [self.summary()]
        for r in self.rows:
            hit = f", {r.cached_tokens} from the prefix cache" if r.cached_tokens else ""
            drafts = f", {r.num_draft_tokens} drafts" if r.num_draft_tokens else ""
            lines.append(f"  {r.kind:7s} {r.request_id}: tokens {r.start}-{r.start + r.num_tokens} "
                         f"({r.num_tokens}{hit}{drafts}), new blocks {list(r.new_block_ids)}")
        lines += [f"  preempted {p.request_id}: {p.reason}" for p in self.preemptions]
        lines += [f"  finished {rid} ({reason})" for rid, reason in self.finished]
        lines += [f"  block table {rid}: {list(ids)}" for rid, ids in self.block_tables.items()]
        return "\n".join(lines)


def out_of_blocks_reason(kv: KVCacheManager, req: Request, num_new_tokens: int) -> str:
    """Why the scheduler must preempt: req cannot get room for its next tokens. Runs only on that rare
    path."""
    needed = -(-(req.num_computed_tokens + num_new_tokens) // kv.block_size) - kv.num_blocks_held(req.request_id)
    free = kv.pool.num_free_blocks
    return (f"out of blocks: request {req.request_id!r} needed {needed} block{'s' * (needed != 1)}, "
            f"{free} free")


StepListener = Callable[[StepReport], None]


@dataclass
class _Partial:
    """What is known of the step under way: before it, and once it was scheduled."""

    started: float
    pool_before: PoolCounts
    held_before: dict[str, int]  # request id -> blocks held
    running_before: set[str]
    sched: SchedulerOutput | None = None
    rows: tuple[BatchRow, ...] = ()
    waiting: tuple[str, ...] = ()
    waiting_reason: str | None = None
    block_tables: dict[str, tuple[int, ...]] = field(default_factory=dict)


class StepRecorder:
    """Attached to an engine while someone listens; turns each step into a StepReport for listeners.

    The engine calls begin() before the step, scheduled() right after the scheduler decided (the moment
    the waiting queue's reason and the batch's block tables are true) and end() with the step's outputs.
    """

    def __init__(self, first_step: int = 1) -> None:
        self.listeners: list[StepListener] = []
        self.last: StepReport | None = None
        self.num_steps = first_step - 1
        self._step: _Partial | None = None

    def begin(self, engine: LLMEngine) -> None:
        self._step = _Partial(time.perf_counter(), pool_counts(engine.kv_cache_manager.pool),
                              blocks_held(engine), {req.request_id for req in engine.scheduler.running})

    def scheduled(self, engine: LLMEngine, sched: SchedulerOutput) -> None:
        step, scheduler, kv = self._step, engine.scheduler, engine.kv_cache_manager
        step.sched = sched
        step.rows = tuple(_row(s, step.running_before) for s in sched.scheduled)
        step.waiting = tuple(req.request_id for req in scheduler.waiting)
        step.waiting_reason = _waiting_reason(scheduler, kv, sched) if step.waiting else None
        step.block_tables = {req.request_id: tuple(kv.block_ids(req.request_id)) for req in scheduler.running}

    def end(self, engine: LLMEngine, outputs: list[RequestOutput]) -> StepReport:
        """Builds the report and hands it to every listener (on the stepping thread)."""
        step, self._step = self._step, None
        self.num_steps += 1
        report = _report(engine, step, outputs, self.num_steps)
        self.last = report
        for listener in list(self.listeners):
            listener(report)
        return report


def pool_counts(pool: BlockPool) -> PoolCounts:
    return PoolCounts(pool.num_free_blocks, pool.num_cached_blocks, pool.num_blocks - pool.num_free_blocks)


def blocks_held(engine: LLMEngine) -> dict[str, int]:
    held = engine.kv_cache_manager.num_blocks_held
    return {rid: n for rid in engine.scheduler.requests if (n := held(rid))}


def _report(engine: LLMEngine, step: _Partial, outputs: list[RequestOutput], number: int) -> StepReport:
    scheduler, kv, sched = engine.scheduler, engine.kv_cache_manager, step.sched
    block_size = kv.block_size
    rows = step.rows
    hit = sum(row.cached_tokens // block_size for row in rows)
    gained = {row.request_id: len(row.new_block_ids) for row in rows}
    held_after = blocks_held(engine)
    freed = sum(max(0, step.held_before.get(rid, 0) + gained.get(rid, 0) - held_after.get(rid, 0))
                for rid in step.held_before.keys() | gained.keys())
    reasons = sched.preemption_reasons if sched is not None else {}
    preempted = sched.preempted if sched is not None else []
    return StepReport(
        step=number, rows=rows, num_batched_tokens=sum(row.num_tokens for row in rows),
        max_num_batched_tokens=scheduler.max_num_batched_tokens, num_running=len(step.block_tables),
        max_num_seqs=scheduler.max_num_seqs, waiting=step.waiting, waiting_reason=step.waiting_reason,
        blocks_allocated=sum(gained.values()) - hit, blocks_hit=hit, blocks_freed=freed,
        preemptions=tuple(Preemption(req.request_id, reasons.get(req.request_id, "preempted"),
                                     step.held_before.get(req.request_id, 0)) for req in preempted),
        finished=tuple((out.request_id, _finish_reason(out)) for out in outputs if out.finished),
        block_tables=step.block_tables, pool_before=step.pool_before, pool_after=pool_counts(kv.pool),
        block_size=block_size, duration_s=time.perf_counter() - step.started)


def _row(s: ScheduledRequest, running_before: set[str]) -> BatchRow:
    req = s.request
    admitted = req.request_id not in running_before
    num_drafts = len(s.draft_token_ids)
    decode = not admitted and s.num_new_tokens == 1 + num_drafts and s.start >= req.num_prompt_tokens and s.samples
    # A request re-sent whole after an interrupted step (is_new while running) gets no new blocks.
    new_block_ids = tuple(s.new_block_ids) if admitted or not s.is_new else ()
    return BatchRow(req.request_id, "decode" if decode else "prefill", s.start, s.num_new_tokens,
                    req.num_prompt_tokens, s.start if admitted else 0, new_block_ids, s.samples, admitted, num_drafts)


def _finish_reason(out: RequestOutput) -> str:
    if out.error is not None:
        return "error"
    reasons = {c.finish_reason for c in out.outputs if c.finish_reason}
    return ", ".join(sorted(reasons)) or "finished"


def _waiting_reason(scheduler: Scheduler, kv: KVCacheManager, sched: SchedulerOutput) -> str:
    """Why the head of the waiting queue was not admitted, in the scheduler's order of checks."""
    if sched.preempted:
        return "the pool ran short this step (a preemption): no admissions until the next"
    if len(scheduler.running) >= scheduler.max_num_seqs:
        return f"max_num_seqs={scheduler.max_num_seqs} requests already running"
    budget = scheduler.max_num_batched_tokens - sched.num_scheduled_tokens
    if budget <= 0:
        return f"the token budget (max_num_batched_tokens={scheduler.max_num_batched_tokens}) is used up"
    # The scheduler's own arithmetic (KVCacheManager.allocate_slots): new blocks for the next chunk, plus
    # the prefix-hit blocks that sit on the free list (cached, unreferenced) and must come off it.
    head = scheduler.waiting.peek()
    hit = kv.find_prefix_hit(head)
    chunk = min(head.num_tokens - hit.num_tokens, budget)
    new = -(-(hit.num_tokens + chunk) // kv.block_size) - len(hit.blocks)
    reclaimed = sum(block.ref_cnt == 0 for block in hit.blocks)
    needed = new + reclaimed
    why = f" ({new} new + {reclaimed} cached ones taken back off the free list)" if reclaimed else ""
    return (f"out of blocks: request {head.request_id!r} needs {needed} free block{'s' * (needed != 1)} for its "
            f"next {chunk} tokens{why}, {kv.pool.num_free_blocks} free")
