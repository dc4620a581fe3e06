"""Drives the engine from a notebook: one stepping mechanism for synchronous calls and for an asyncio
task on the running loop, with every output routed to the consumer of its request.

Everything that steps the engine goes through `EngineDriver.step()`, so outputs are never lost: a
synchronous `generate` running in a cell steps the engine for everyone, and the outputs of background
streams land in their queues, to be read when the loop gets its turn back. No event-loop nesting is
needed: a synchronous call simply runs the steps on its own thread.

Ctrl-C never cuts a step, a submit, an abort or a close in half: they run with interrupts deferred
(engine/interrupts.py), so one takes effect at the end of the step it arrived in, in whichever code
was interrupted: a synchronous `generate` aborts its own requests; an interrupt that lands while the
loop task steps is raised from the loop to whoever runs it, as Python raises it from any code running
there, and the task goes on serving every stream.

A step-through debugger pauses the background task (`pause()`): requests still queue, streams wait,
and each `debug_step()` runs one step and returns its StepReport (engine/step_report.py); `resume()`
lets the task step again. A synchronous `generate` refuses to start while paused rather than wait: it
would hold the kernel, so the click on "Step" or "Run" that it waits for could never arrive.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from pagednb.engine.interrupts import deferred_interrupts
from pagednb.engine.llm_engine import LLMEngine
from pagednb.engine.step_report import StepListener, StepRecorder, StepReport
from pagednb.outputs import RequestOutput
from pagednb.request import Request

logger = logging.getLogger("pagednb")
Sink = Callable[[RequestOutput], None]


class EngineDeadError(RuntimeError):
    """The engine hit an internal error it cannot recover from; create a new LLM."""


class EngineDriver:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._sinks: dict[str, Sink] = {}
        self._step_lock = threading.RLock()  # one step at a time, whichever thread asks
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._work: asyncio.Event | None = None
        self.dead: BaseException | None = None
        self.num_steps = 0
        self.paused = False

    # ---- submitting and aborting -----------------------------------------------------------------
    def submit(self, req: Request, sink: Sink) -> None:
        """Queues a checked request; every output for it goes to `sink` (on the stepping thread)."""
        self._check_alive()
        with deferred_interrupts(), self._step_lock:  # the sink and the request are added together
            self._sinks[req.request_id] = sink
            try:
                self.engine.enqueue(req)
            except BaseException:
                del self._sinks[req.request_id]
                raise
            self._wake()

    def abort(self, request_id: str | list[str]) -> None:
        """Thread-safe. The request ends with finish_reason "abort" at the next step boundary."""
        with deferred_interrupts():
            self.engine.abort_request(request_id)
            self._wake()

    @property
    def held_ids(self) -> set[str]:
        """The requests whose consumer is busy with its last output: the engine builds none for them but
        their final one, and the next output carries every token since (engine/output_processor.py). A
        consumer adds its request's id when it takes an output and discards it when it waits for the
        next, or has the final one (streams.py); from any thread."""
        return self.engine.output_processor.held_ids

    def consumer_ids(self) -> list[str]:
        """The requests whose outputs still go to a consumer (empty once every request ended)."""
        return list(self._sinks)

    # ---- stepping --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; each output goes to its request's sink. Returns the outputs."""
        self._check_alive()
        with deferred_interrupts(), self._step_lock:
            try:
                outputs = self.engine.step()
            except Exception as error:  # outside the model: the engine's own state may be broken
                self._die(error)
                raise
            self.num_steps += 1
            self._hand_off(outputs)
        return outputs

    def _hand_off(self, outputs: list[RequestOutput]) -> None:
        sinks = self._sinks
        for out in outputs:
            sink = sinks.pop(out.request_id, None) if out.finished else sinks.get(out.request_id)
            if sink is None:
                continue
            try:
                sink(out)
            except Exception:  # one broken consumer must not keep the others' outputs from them
                logger.exception("The consumer of request %r failed; the request is aborted", out.request_id)
                sinks.pop(out.request_id, None)
                self.engine.abort_request(out.request_id)

    def run_until(self, done: Callable[[], bool]) -> None:
        """Steps on the caller's thread until done() (no event loop, so no nesting, is needed). An
        interrupt takes effect between two steps."""
        with deferred_interrupts() as interrupts:
            while not done():
                self.step()
                interrupts.deliver_pending()

    # ---- pausing and single steps (the step debugger) ----------------------------------------------
    def pause(self) -> None:
        """The background task stops stepping after the step under way; requests keep queueing."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._wake()

    def check_not_paused(self) -> None:
        if self.paused:
            raise RuntimeError("the engine is paused by the step debugger: a synchronous generate()/chat() "
                               "would hold the kernel, so no Step or Run click could reach it. Press Run (or "
                               "call llm.resume()) first, or use llm.stream() / pagednb.notebook.stream(), "
                               "whose requests wait in the queue for the next step")

    def debug_step(self) -> StepReport:
        """Runs one step (paused or not) and returns what it decided."""
        with self._step_lock:
            recorder = self._recorder()
            try:
                self.step()
            finally:
                self._drop_recorder_if_unused()
            return recorder.last

    def add_step_listener(self, listener: StepListener) -> None:
        """listener(report) after every step, on the stepping thread, until removed; steps cost a
        little more while any listens."""
        with self._step_lock:
            self._recorder().listeners.append(listener)

    def remove_step_listener(self, listener: StepListener) -> None:
        with self._step_lock:
            recorder = self.engine.step_recorder
            if recorder is not None and listener in recorder.listeners:
                recorder.listeners.remove(listener)
            self._drop_recorder_if_unused()

    def _recorder(self) -> StepRecorder:
        if self.engine.step_recorder is None:
            self.engine.step_recorder = StepRecorder(first_step=self.engine.num_steps_launched + 1)
        return self.engine.step_recorder

    def _drop_recorder_if_unused(self) -> None:
        recorder = self.engine.step_recorder
        if recorder is not None and not recorder.listeners:
            self.engine.step_recorder = None

    # ---- the background task ---------------------------------------------------------------------
    def ensure_background_loop(self) -> None:
        """Starts the stepping task on the running loop (the kernel's, in Jupyter) if not running."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        self._loop, self._work = loop, asyncio.Event()
        self._task = loop.create_task(self._background(), name="pagednb-engine-loop")

    @property
    def background_task(self) -> asyncio.Task | None:
        """The task stepping the engine on its loop (None before the first stream): to check that it is
        alive, or to see what it waits on in a debugger."""
        return self._task

    async def _background(self) -> None:
        """Serves until the engine closes or dies. An interrupt that lands in this task (Python raises
        it in whatever code runs) is re-raised from the loop, to the loop's runner, as a callback's
        would be; the task itself carries on, so no stream is left without a stepper."""
        while True:
            try:
                await self._serve()
                return
            except KeyboardInterrupt as interrupt:
                self._loop.call_soon(_raise, interrupt)

    async def _serve(self) -> None:
        """One step, then a turn for everyone else on the loop; sleeps (no spinning) when idle."""
        while self.dead is None and not self.engine.closed:
            if self.paused or not self.engine.has_unfinished_requests():
                self._work.clear()
                if self.paused or not self.engine.has_unfinished_requests():  # a submit may have raced the clear
                    await self._work.wait()
                continue
            try:
                stepped = self._step_unless_busy()
            except Exception:
                if not self.engine.closed:  # (closed by another thread meanwhile: nothing went wrong)
                    logger.exception("The engine loop stopped")
                return
            await asyncio.sleep(0 if stepped else 0.001)  # busy: another thread is stepping for us

    def _step_unless_busy(self) -> bool:
        """Steps unless another thread is stepping (the loop's thread must not block on it)."""
        with deferred_interrupts():  # no interrupt between taking the lock and releasing it
            if not self._step_lock.acquire(blocking=False):
                return False
            try:
                self.step()
            finally:
                self._step_lock.release()
        return True

    def _wake(self) -> None:
        """Wakes the idle loop task; safe from any thread (widget callbacks may run on another)."""
        loop, work = self._loop, self._work
        if loop is None or work is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(work.set)
        except RuntimeError:  # the loop is closing
            pass

    # ---- failure and shutdown --------------------------------------------------------------------
    def _die(self, error: BaseException) -> None:
        logger.error("The engine cannot continue after an internal error (%r); every request ends with "
                     "this error. Create a new LLM.", error)
        self.dead = error
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            try:
                sink(RequestOutput(request_id, None, [], [], finished=True, error=error))
            except Exception:
                logger.exception("The consumer of request %r failed", request_id)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.dead!r}") from self.dead
        if self.engine.closed:
            raise RuntimeError("the engine is closed")

    def close(self) -> None:
        """Ends every request (finish_reason "abort", delivered to its consumer), stops the loop task,
        and gives the model and the KV cache memory back."""
        with deferred_interrupts(), self._step_lock:
            if self.engine.closed:
                return
            try:
                if self.dead is None:
                    self.abort(list(self.engine.scheduler.requests))
                    while self.engine.has_unfinished_requests():
                        self.step()
            finally:
                self._stop_task()
                self.engine.close()

    def _stop_task(self) -> None:
        """Cancels the loop task, so that it finishes instead of being destroyed pending (asyncio logs
        "Task was destroyed but it is pending" for that) when the engine is dropped."""
        task, loop = self._task, self._loop
        if task is None or task.done():
            return
        if loop.is_closed() or not loop.is_running():
            # It can never run again (or only if someone runs this loop again): it ends with the
            # loop, having nothing to clean up, so its destruction is not worth a warning.
            task._log_destroy_pending = False
        if loop.is_closed():
            return
        if _running_loop() is loop:
            task.cancel()
        else:
            loop.call_soon_threadsafe(task.cancel)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _raise(error: BaseException) -> None:
    raise error
