"""Drives the engine from a notebook: one stepping mechanism for synchronous calls and for an asyncio
task on the running loop, with every output routed to the consumer of its request.

Everything that steps the engine goes through `EngineDriver.step()`, so outputs are never lost: a
synchronous `generate` running in a cell steps the engine for everyone, and the outputs of background
streams land in their queues, to be read when the loop gets its turn back. No event-loop nesting is
needed: a synchronous call simply runs the steps on its own thread.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from pagednb.engine.llm_engine import LLMEngine
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

    # ---- submitting and aborting -----------------------------------------------------------------
    def submit(self, req: Request, sink: Sink) -> None:
        """Queues a checked request; every output for it goes to `sink` (on the stepping thread)."""
        self._check_alive()
        with self._step_lock:
            self._sinks[req.request_id] = sink
            self.engine.enqueue(req)
        self._wake()

    def abort(self, request_id: str | list[str]) -> None:
        """Thread-safe. The request ends with finish_reason "abort" at the next step boundary."""
        self.engine.abort_request(request_id)
        self._wake()

    # ---- stepping --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; each output goes to its request's sink. Returns the outputs."""
        self._check_alive()
        with self._step_lock:
            try:
                outputs = self.engine.step()
            except Exception as error:  # outside the model: the engine's own state may be broken
                self._die(error)
                raise
            self.num_steps += 1
            for out in outputs:
                sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
                if sink is not None:
                    sink(out)
        return outputs

    def run_until(self, done: Callable[[], bool]) -> None:
        """Steps on the caller's thread until done() (no event loop, so no nesting, is needed)."""
        while not done():
            self.step()

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
        """One step, then a turn for everyone else on the loop; sleeps (no spinning) when idle."""
        while self.dead is None and not self.engine.closed:
            if not self.engine.has_unfinished_requests():
                self._work.clear()
                if not self.engine.has_unfinished_requests():  # re-check: a submit may have raced the clear
                    await self._work.wait()
                continue
            if not self._step_lock.acquire(blocking=False):  # another thread is stepping for us
                await asyncio.sleep(0.001)
                continue
            try:
                self.step()
            except Exception:
                logger.exception("The engine loop stopped")
                return
            finally:
                self._step_lock.release()
            await asyncio.sleep(0)

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
            sink(RequestOutput(request_id, None, [], [], finished=True, error=error))

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.dead!r}") from self.dead
        if self.engine.closed:
            raise RuntimeError("the engine is closed")

    def close(self) -> None:
        """Ends every request (finish_reason "abort", delivered to its consumer), stops the loop, and
        gives the model and the KV cache memory back."""
        if self.engine.closed:
            return
        if self.dead is None:
            self.abort(list(self.engine.scheduler.requests))
            while self.engine.has_unfinished_requests():
                self.step()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._wake()
        self.engine.close()

