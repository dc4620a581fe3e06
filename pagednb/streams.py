"""`RequestStream`: one request's outputs as an async iterator, fed by the engine driver."""
from __future__ import annotations

import asyncio
import threading

from pagednb.engine.driver import EngineDriver
from pagednb.outputs import RequestOutput


class RequestStream:
    """`async for out in stream` yields the request's outputs until the final one.

    Leaving early — `break`, `aclose()`, or the consuming task being cancelled — aborts the request,
    so its KV blocks come back at the next step boundary. A request that fails raises its error here.
    """

    def __init__(self, driver: EngineDriver, request_id: str) -> None:
        self.request_id = request_id
        self._driver = driver
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._done = False
        self.sink = _queue_sink(self._queue, self._loop, self._loop_thread)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except BaseException:  # the consuming task was cancelled
            self.abort()
            raise
        if out.error is not None:
            self._done = True
            raise out.error
        self._done = out.finished
        return out

    def abort(self) -> None:
        """Ends the request early (thread-safe); the stream ends too."""
        if not self._done:
            self._done = True
            self._driver.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    def __del__(self) -> None:  # a `break` out of `async for` drops the last reference
        try:
            self.abort()
        except Exception:  # interpreter shutdown or a closed engine: nothing left to free
            pass


def _queue_sink(queue: asyncio.Queue, loop: asyncio.AbstractEventLoop, loop_thread: int):
    """The function the driver calls with each output, on whichever thread steps the engine. It holds
    the queue, not the stream, so dropping the stream (a `break`) lets it be collected and abort."""
    def put(out: RequestOutput) -> None:
        if threading.get_ident() == loop_thread:
            queue.put_nowait(out)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, out)
    return put
