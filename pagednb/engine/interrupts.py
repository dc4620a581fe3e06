"""Holds Ctrl-C back while the engine's bookkeeping is half-done.

Python raises KeyboardInterrupt at whatever bytecode the main thread runs when SIGINT arrives. Inside a
step that can leave a request RUNNING with a token pending forever, a block with a reference count and no
holder, or an output that never reaches its stream. `deferred_interrupts()` wraps such sections: on the
main thread it swaps in a SIGINT handler that only records the signal, and when the outermost section
ends it restores the previous handler and hands it the recorded signal. The interrupt then does exactly
what it would have done, one step boundary later: Python's default handler raises KeyboardInterrupt,
asyncio.run's cancels its main task, ipykernel's (around an async cell) cancels the cell, SIG_IGN (an
idle ipykernel) drops it. A long section may hand it over earlier, at a safe point, with
`deliver_pending()` (LLM.generate does, between steps).

Off the main thread it does nothing: Python runs signal handlers on the main thread only, so no
KeyboardInterrupt can land in another thread's step. The cost is two handler swaps per outermost
section, about 0.5 us in all (benchmarks/scheduler_overhead.py measures steps with it).
"""
from __future__ import annotations

import signal
import threading
from types import FrameType

try:  # the C functions: `signal`'s wrappers turn handlers into enums through a raised ValueError, ~1 us each
    from _signal import getsignal as _get_handler, signal as _set_handler
except ImportError:  # not CPython
    from signal import getsignal as _get_handler, signal as _set_handler

_MAIN_THREAD_ID = threading.main_thread().ident
_SIGINT = int(signal.SIGINT)


class InterruptDeferral:
    """The main thread's deferral. SIGINT's handler is process-wide, so there is exactly one of these,
    and sections nest: only the outermost swaps handlers."""

    def __init__(self) -> None:
        self._depth = 0
        self._previous = None  # the handler to restore and to hand the interrupt to; None: not swapped
        self._pending: tuple[int, FrameType | None] | None = None

    def __enter__(self) -> InterruptDeferral:
        if threading.get_ident() == _MAIN_THREAD_ID:
            if self._depth == 0:
                self._swap_in()
            self._depth += 1  # (an interrupt from here on is only recorded)
        return self

    def __exit__(self, *exc_info) -> None:
        if threading.get_ident() == _MAIN_THREAD_ID:
            self._depth -= 1
            if self._depth == 0:
                self._swap_out()

    def deliver_pending(self) -> None:
        """Inside a section, at a point where an interrupt is safe: hands a recorded one over now."""
        if self._pending is not None and threading.get_ident() == _MAIN_THREAD_ID:
            signum, frame = self._pending
            self._pending = None
            _deliver(self._previous, signum, frame)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._pending = (signum, frame)

    def _swap_in(self) -> None:
        previous = _get_handler(_SIGINT)
        if previous is None:  # installed outside Python: it could not be restored, so leave it alone
            return
        self._pending = None  # one that raced the end of the last section was handled by then
        # (signal.signal raises an interrupt that is already pending before it swaps: none is lost)
        self._previous = _set_handler(_SIGINT, self._record)

    def _swap_out(self) -> None:
        previous = self._previous
        if previous is None:
            return
        self._previous = None
        _set_handler(_SIGINT, previous)  # from here on, an interrupt goes straight to it
        pending, self._pending = self._pending, None
        if pending is not None:
            _deliver(previous, *pending)


def _deliver(handler, signum: int, frame: FrameType | None) -> None:
    """What the signal would have done on arrival, under the handler that was installed then."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)  # the default action (the process ends), as it would have
    # SIG_IGN: ignored, as it would have been


_DEFERRAL = InterruptDeferral()


def deferred_interrupts() -> InterruptDeferral:
    """`with deferred_interrupts():` a section that Ctrl-C must not cut in half (see the module doc)."""
    return _DEFERRAL
