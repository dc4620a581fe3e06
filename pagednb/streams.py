"""`RequestStream`: one request's outputs as an async iterator, fed by the engine driver."""
from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Callable

from pagednb.engine.driver import EngineDriver
from pagednb.engine.interrupts import deferred_interrupts
from pagednb.engine.parallel_sampling import ParentRequest
from pagednb.outputs import RequestOutput
from pagednb.request import Request


class RequestStream:
    """`async for out in stream` yields the request's outputs until the final one.

    Leaving the loop early — `break`, an exception, the consuming task being cancelled — aborts the
    request, so its KV blocks come back at the next step boundary. That holds even while the stream is
    still referenced (`s = llm.stream(...)`; `async for out in s: ... break`): each `async for` reads
    through an async generator of its own, which Python closes when the loop is left (asyncio runs the
    close on the loop's next turn). `async with llm.stream(...) as s:` aborts the moment the block is
    left, whatever happened inside it. A request that fails raises its error here.

    The engine builds an output for the stream only when its consumer waits for one: a consumer slower
    than the engine gets fewer outputs, each with everything produced since the last (DELTA texts still
    join to the whole text), instead of a backlog of one per step. `pace()` spaces them further.
    """

    def __init__(self, driver: EngineDriver, request_id: str, owner: object = None) -> None:
        self.request_id = request_id
        self._driver = driver
        self._owner = owner  # what owns the engine (the LLM): kept alive, and so open, while this is
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._done = True  # until start(): there is nothing to abort
        self._loop = asyncio.get_running_loop()
        self._interval = 0.0  # pace()
        self._ready_at = 0.0  # loop time before which no output is built for this stream (pace())
        self._release: asyncio.TimerHandle | None = None  # the paced release, while one is due
        self.sink = _queue_sink(self._queue, self._loop, functools.partial(driver.abort, request_id))

    def start(self, req: Request | ParentRequest) -> None:
        """Submits the request (with n > 1, its n completions: each output carries the completions by
        .index, engine/parallel_sampling.py); its outputs then come here. An interrupt while submitting
        aborts it: the caller never receives the stream, so nobody could read it."""
        try:
            with deferred_interrupts():
                self._driver.submit(req, self.sink)
                self._done = False
        except BaseException:
            self.abort()
            raise

    def pace(self, interval: float) -> None:
        """After each output taken, the engine builds the next one no sooner than `interval` seconds
        later (the final one comes at once): for a consumer that sends less often than the engine
        steps (the HTTP server), one output per interval instead of one per step at hundreds of
        streams is host time the GPU does not wait for."""
        self._interval = interval

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                try:
                    out = await self.__anext__()
                except StopAsyncIteration:
                    return
                yield out
        finally:  # the loop was left, one way or another (a no-op after the final output)
            self.abort()

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if self._queue.empty():
            self._ready_for_output()
        try:
            out = await self._queue.get()
        except BaseException:  # the consuming task was cancelled or interrupted
            self.abort()
            raise
        self._took(out)
        return out

    def _took(self, out: RequestOutput) -> None:
        """The consumer has the output: until it waits for the next one, the engine builds none (the
        tokens meanwhile come together in the next). Raises the request's error."""
        self._done = out.finished or out.error is not None
        if self._done:
            self._stop_holding()
            if out.error is not None:
                raise out.error
            return
        self._driver.held_ids.add(self.request_id)
        if self._interval:
            self._ready_at = self._loop.time() + self._interval

    def _ready_for_output(self) -> None:
        """The consumer waits: the engine may build the next output now, or once the pace allows."""
        release = self._driver.held_ids.discard
        delay = self._ready_at - self._loop.time() if self._interval else 0.0
        if delay <= 0:
            release(self.request_id)
        else:
            self._release = self._loop.call_later(delay, release, self.request_id)

    def _stop_holding(self) -> None:
        """The stream ended: its id leaves the held set, and a paced release still due is dropped."""
        self._driver.held_ids.discard(self.request_id)
        if self._release is not None:
            self._release.cancel()

    def take_ready(self) -> list[RequestOutput]:
        """The outputs already queued, without waiting: a consumer that sends less often than the engine
        steps (the HTTP server) takes them together. Raises the request's error as __anext__ does."""
        ready = []
        while not self._done and not self._queue.empty():
            out = self._queue.get_nowait()
            self._took(out)
            ready.append(out)
        return ready

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.abort()

    def abort(self) -> None:
        """Ends the request early (thread-safe); the stream ends too."""
        if not self._done:
            self._done = True
            self._driver.abort(self.request_id)
            self._driver.held_ids.discard(self.request_id)  # (any thread: a due release fires harmlessly)

    async def aclose(self) -> None:
        self.abort()

    def __del__(self) -> None:  # the last reference dropped while the request still runs
        try:
            self.abort()
        except Exception:  # interpreter shutdown or a closed engine: nothing left to free
            pass


def _queue_sink(queue: asyncio.Queue, loop: asyncio.AbstractEventLoop,
                abort: Callable[[], None]) -> Callable[[RequestOutput], None]:
    """The function the driver calls with each output, on whichever thread steps the engine. It holds
    the queue, not the stream, so dropping the stream lets it be collected (and abort). Once the
    consumer's loop is closed nobody can read the stream: the request is aborted."""
    loop_thread = threading.get_ident()  # streams are made on their loop's thread

    def put(out: RequestOutput) -> None:
        if loop.is_closed():
            if not out.finished:
                abort()
        elif threading.get_ident() == loop_thread:
            queue.put_nowait(out)
        else:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the loop closed meanwhile
                if not out.finished:
                    abort()
    return put
