"""Ctrl-C at any instant of a step breaks nothing: a real SIGINT (os.kill, delivered by Python's own signal
machinery) is sent at the k-th entry of each function one step runs, in turn, while background streams
and a synchronous generate share the engine.

The step path is found by tracing: one traced run lists every entry (call or resumption) of pagednb's
engine, stream and LLM code from just before a step until the next step starts: scheduling, the
launch, commit_computed, update_from_output, _process, kv.free and pool.free of a finishing and of an
aborted request, release_requests, the hand-off to every stream's sink, the consumers reading their
streams, and the interrupt deferral itself. Then for each (function, k) a run sends SIGINT right at that
entry. Afterwards every stream has ended, the interrupted party alone was affected, the engine holds no
blocks and no bookkeeping, and it serves a new request exactly as a fresh engine does.
"""
from __future__ import annotations

import asyncio
import inspect
import os
import signal
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

import pagednb
from pagednb import LLM, SamplingParams
from pagednb.engine import llm_engine
from pagednb.engine.driver import EngineDriver
from pagednb.engine.interrupts import deferred_interrupts

PACKAGE = Path(pagednb.__file__).parent
TRACED_FILES = (str(PACKAGE / "engine") + os.sep, str(PACKAGE / "streams.py"), str(PACKAGE / "llm.py"))
STEP_CODE = EngineDriver.step.__code__


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


# Prompts share prefixes (prefix-cache hits, blocks shared within a step) and fill blocks of 8 tokens. In
# the traced step the 3-token stream finishes (its blocks go back through kv.free and pool.free), the
# leaver's abort is applied (it breaks after its first output), and the 14-token stream's second block
# fills up (commit_computed caches it).
STREAMS = [("Once upon a time there was a cat named Tom", 3), ("The dog named Max ran to the sun", 4),
           ("Once upon a time there was a dog", 9)]
LEAVER = ("Paged attention stores the key value cache", 30)
SYNC = [("Once upon a time there was a cat who liked milk", 5), ("Continuous batching lets new requests join", 5)]
FRESH = ("The dog named Max found a red ball", 8)
STREAMS_END_WITHIN_S = 20  # (they take milliseconds)


def make_llm(model_dir: Path, async_scheduling: bool) -> LLM:
    return LLM(str(model_dir), block_size=8, num_kv_blocks=64, max_model_len=128, async_scheduling=async_scheduling)


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> dict[str, list[int]]:
    """Every prompt's greedy tokens from a fresh engine, alone."""
    with make_llm(tiny_model_dir("llama"), async_scheduling=False) as llm:
        return {p: llm.generate(p, greedy(n), use_tqdm=False)[0].outputs[0].token_ids
                for p, n in STREAMS + SYNC + [FRESH, LEAVER]}


class EntryHook:
    """A sys.settrace hook that, once armed, counts entries of pagednb's engine/stream/LLM functions.
    Without a target it records them from arming until the second driver step starts (one step and
    what leads to it); with a target (code, k) it sends SIGINT at that function's k-th entry.

    Entries are calls and coroutine resumptions. A plain generator counts at its first entry only: its
    later "calls" include its finalization, where Python prints and drops any exception ("Exception
    ignored in"), so an interrupt landing there is lost by the language itself; `__del__` likewise."""

    def __init__(self, target: tuple | None = None) -> None:
        self.target = target
        self.armed = False
        self.fired = False
        self.counts: Counter = Counter()
        self.entries: list[tuple] = []
        self._steps = 0
        self._generator_frames: dict[int, object] = {}  # id -> frame (held, so that ids stay unique)

    def __call__(self, frame, event, arg):
        if self.armed and event == "call" and frame.f_code.co_filename.startswith(TRACED_FILES):
            code = frame.f_code
            if code.co_flags & inspect.CO_GENERATOR:
                if id(frame) in self._generator_frames:
                    return None
                self._generator_frames[id(frame)] = frame
            if not _in_finalizer(frame):
                self._enter(code)
        return None

    def _enter(self, code) -> None:
        self.counts[code] += 1
        if self.target is None:
            self._steps += code is STEP_CODE
            if self._steps == 2:
                self.armed = False
                return
            self.entries.append((code, self.counts[code]))
        elif (code, self.counts[code]) == self.target:
            self.armed, self.fired = False, True
            os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode check: this function's entry


def _in_finalizer(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


@dataclass
class Outcome:
    streams: list = field(default_factory=list)  # per stream: its outputs, or the exception that ended it
    leaver: object = None
    sync: object = None  # generate's outputs, or its KeyboardInterrupt
    loop_interrupts: int = 0  # KeyboardInterrupts raised out of the loop (from a task)
    stream_ids: list[str] = field(default_factory=list)


def run_scenario(llm: LLM, variant: str, hook: EntryHook, runner: str = "loop") -> Outcome:
    """Streams run on a loop; after two or three steps the hook is armed, then either generate runs (variant
    "sync": it steps for everyone) or the loop task steps on ("background"). runner "loop" runs the
    loop under Python's default SIGINT handler (KeyboardInterrupt where the interrupt lands) and runs it
    again after each interrupt, as a notebook's loop goes on; "asyncio.run" uses asyncio.run's handler
    (it cancels the main task)."""
    outcome = Outcome()
    base = llm.driver.num_steps
    # the step after arming is the one where the 3-token stream finishes and the leaver's abort is
    # applied; with asynchronous scheduling a token is processed one step after it was sampled
    arm_after = 3 if llm.engine.async_scheduling else 2

    async def consume(i: int, prompt: str, n: int) -> list:
        request_id = f"s{base}-{i}"
        outcome.stream_ids.append(request_id)
        async with llm.stream(prompt, greedy(n), request_id=request_id) as stream:
            return [out async for out in stream]

    async def leave() -> str:
        outcome.stream_ids.append(f"leaver{base}")
        async for _ in llm.stream(LEAVER[0], greedy(LEAVER[1]), request_id=f"leaver{base}"):
            break
        return "left"

    async def main() -> list:
        tasks = [asyncio.create_task(consume(i, p, n)) for i, (p, n) in enumerate(STREAMS)]
        tasks.append(asyncio.create_task(leave()))
        while llm.driver.num_steps < base + arm_after:
            await asyncio.sleep(0)
        sys.settrace(hook)
        hook.armed = True
        if variant == "sync":
            try:
                outcome.sync = llm.generate([p for p, _ in SYNC], [greedy(n) for _, n in SYNC], use_tqdm=False)
            except KeyboardInterrupt as interrupt:
                outcome.sync = interrupt
        try:
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), STREAMS_END_WITHIN_S)
        except asyncio.TimeoutError:
            raise AssertionError("the streams never ended") from None

    previous_trace = sys.gettrace()
    try:
        if runner == "asyncio.run":
            try:
                results = asyncio.run(main())
            except KeyboardInterrupt:
                outcome.loop_interrupts += 1
                results = None
        else:
            results = _run_on_a_loop(llm, main(), outcome)
    finally:
        sys.settrace(previous_trace)
    if results is not None:
        outcome.streams, outcome.leaver = results[:-1], results[-1]
    return outcome


def _run_on_a_loop(llm: LLM, coro, outcome: Outcome):
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(coro)
        while not task.done():
            try:
                loop.run_until_complete(task)
            except KeyboardInterrupt:  # raised out of the loop by a task it landed in; run the loop on
                outcome.loop_interrupts += 1
        for _ in range(200):  # an aborted request's blocks come back at the next step of the loop task
            if not llm.engine.has_unfinished_requests():
                break
            loop.run_until_complete(asyncio.sleep(0))
        return task.result()
    finally:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def check_outcome(outcome: Outcome, expected: dict, variant: str) -> None:
    """Exactly one party saw the interrupt, and every other stream and call got its full output."""
    complete = [isinstance(r, list) and r[-1].finished and r[-1].outputs[0].token_ids == expected[p]
                for r, (p, _) in zip(outcome.streams, STREAMS)]
    interrupted_streams = [r for r in outcome.streams if isinstance(r, KeyboardInterrupt)]
    assert all(ok or isinstance(r, KeyboardInterrupt) for ok, r in zip(complete, outcome.streams)), outcome.streams
    assert outcome.leaver == "left" or isinstance(outcome.leaver, KeyboardInterrupt)
    if variant == "sync":  # generate steps for everyone, so it is the one interrupted
        assert isinstance(outcome.sync, KeyboardInterrupt) and outcome.loop_interrupts == 0
        assert all(complete) and outcome.leaver == "left"
    else:  # the loop task (it carries on) or one consumer (its stream alone ends) was interrupted
        assert outcome.loop_interrupts == 1
        assert len(interrupted_streams) + isinstance(outcome.leaver, KeyboardInterrupt) <= 1


def check_clean(llm: LLM, outcome: Outcome) -> None:
    """No request, block, sink, in-flight step or tracked output left behind."""
    stats = llm.stats()
    assert stats["used_blocks"] == 0 and stats["running"] == 0 and stats["waiting"] == 0, stats
    assert not llm.engine.has_unfinished_requests()  # no pending abort, no step in flight
    assert llm.engine.scheduler.requests == {} and llm.driver.consumer_ids() == []
    assert not any(llm.engine.output_processor.has_request(r)
                   for r in outcome.stream_ids + [str(i) for i in range(2000)])
    llm.engine.check_integrity()


def check_serves(llm: LLM, expected: dict) -> None:
    out = llm.generate(FRESH[0], greedy(FRESH[1]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[FRESH[0]]
    assert set(llm.engine.runner.block_table.row_of) <= {out.request_id}  # every other row released
    check_clean(llm, Outcome())


def trace_step_path(model_dir: Path, async_scheduling: bool, variant: str) -> list[tuple]:
    hook = EntryHook()
    with make_llm(model_dir, async_scheduling) as llm:
        run_scenario(llm, variant, hook)
    return hook.entries


def interrupt_everywhere(model_dir: Path, async_scheduling: bool, expected: dict, variant: str,
                         entries: list[tuple], runner: str = "loop") -> None:
    """One run per entry, each on a fresh engine (the same state as the traced run, so the k-th entry
    is the same instant)."""
    for code, k in entries:
        where = f"{variant}: SIGINT at entry {k} of {code.co_qualname} ({Path(code.co_filename).name})"
        hook = EntryHook((code, k))
        llm = make_llm(model_dir, async_scheduling)
        try:
            outcome = run_scenario(llm, variant, hook, runner)
            assert hook.fired, "the traced entry was not reached"
            if runner == "loop":
                check_outcome(outcome, expected, variant)
                check_clean(llm, outcome)
            check_serves(llm, expected)
        except (AssertionError, Exception, KeyboardInterrupt) as failure:  # a KeyboardInterrupt would stop pytest
            raise AssertionError(f"{where}: {failure!r}") from failure
        finally:
            llm.close()


@pytest.fixture(autouse=True)
def quick_engines(monkeypatch):
    """Hundreds of engines: skip the full garbage collections of start-up and close (a GC-pause
    optimisation, 0.3 s per engine, unrelated to what is tested here)."""
    monkeypatch.setattr(llm_engine, "gc", SimpleNamespace(collect=lambda *args: 0))


STEP_PATH = {"Scheduler.schedule", "ModelRunner.launch", "ModelRunner.release_requests", "LLMEngine._process",
             "Scheduler.update_from_output", "KVCacheManager.commit_computed", "KVCacheManager.free",
             "BlockPool.free", "BlockPool.cache_full_block", "EngineDriver._hand_off", "_queue_sink.<locals>.put"}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-scheduling", "async-scheduling"])
@pytest.mark.parametrize("variant", ["sync", "background"])
def test_sigint_at_every_function_entry_of_a_step(tiny_model_dir, expected, variant, async_scheduling):
    model_dir = tiny_model_dir("llama")
    entries = trace_step_path(model_dir, async_scheduling, variant)
    assert STEP_PATH <= {code.co_qualname for code, _ in entries}  # the step really was covered
    interrupt_everywhere(model_dir, async_scheduling, expected, variant, entries)


def test_sigint_under_asyncio_run_cancels_the_main_task_and_breaks_nothing(tiny_model_dir, expected):
    """asyncio.run's own SIGINT handler (it cancels the main task) gets the interrupt at the step's end:
    each function of the step path, at its first entry, once."""
    model_dir = tiny_model_dir("llama")
    entries = [(code, k) for code, k in trace_step_path(model_dir, True, "background") if k == 1]
    interrupt_everywhere(model_dir, True, expected, "background", entries, runner="asyncio.run")


def test_an_interrupt_is_deferred_to_the_end_of_the_section_and_handed_to_the_installed_handler():
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        with deferred_interrupts():
            with deferred_interrupts():  # nested: only the outermost swaps
                os.kill(os.getpid(), signal.SIGINT)
                sum(range(1000))  # bytecodes run: the signal is handled, by the deferral
            assert received == []
        assert received == [signal.SIGINT]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # ignored, as it would have been
    finally:
        signal.signal(signal.SIGINT, previous)
