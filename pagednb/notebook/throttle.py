"""Rate limits for widget updates: the one place that decides when a view may talk to the browser.

Every widget trait change is one comm message on the kernel's IOPub channel. jupyter_server drops
messages above 1,000/s ("IOPub message rate exceeded") and the widgets it drops stay stale, so a view
that re-rendered on every token (hundreds a second, times several streams) would break the notebook.

Two limits apply to every update:
- each `Throttle` (one per kind of update, e.g. one stream's text) runs at most `hz` times a second,
  always rendering the *latest* state (intermediate states are simply skipped), with a trailing call
  so the last state lands even if no new output follows;
- one `MessageBudget` shared by all views caps the total (a token bucket).
`flush()` renders at once regardless of both: final states (a finished stream) must always land, and
there are only a few of them. They, clicks and the pool view's few messages are still counted: they
put the bucket into debt, which the throttled updates then wait out.

Not counted: a widget's `comm_open` (anywidget's too: its JavaScript and CSS travel in it). A view opens
its widgets once, when it is made; they carry their initial state and CSS classes (given to the
constructors, so no update follows), and a cell makes views at human speed, not per token. The token
view is opened only when its toggle is first pressed; the chat opens one bubble per turn.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

TEXT_HZ = 30.0  # per stream: smooth to the eye, ~30 messages/s
STATUS_HZ = 4.0  # token counts and tok/s: readable, not flickering
# All views together. Throttled updates may use 170/s, which leaves room for the sends that cannot
# wait (final flushes, clicks) within ~200/s over any second: 5x under jupyter_server's 1,000/s.
TOTAL_MESSAGES_PER_S = 170.0


class MessageBudget:
    """A token bucket of widget messages shared by every view in the kernel."""

    def __init__(self, rate: float = TOTAL_MESSAGES_PER_S, burst: float = 10.0) -> None:
        self.rate, self.burst = rate, burst
        self._tokens = burst
        self._stamp = time.monotonic()
        self.sent = 0  # messages accounted for so far (for benchmarks and tests)

    def _refill(self, now: float) -> None:
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def wait_time(self, cost: int, now: float) -> float:
        """Seconds until `cost` messages may be sent; 0 if they may go now."""
        self._refill(now)
        return max(0.0, (cost - self._tokens) / self.rate)

    def take(self, cost: int, now: float | None = None) -> None:
        """Accounts for messages sent; may go into debt (forced sends), which later sends wait out."""
        self._refill(time.monotonic() if now is None else now)
        self._tokens -= cost
        self.sent += cost


BUDGET = MessageBudget()


class Throttle:
    """Runs the latest requested render at most `hz` times a second, within the shared budget.

    Renders run on the event loop's thread (the only thread that touches widgets). `request()` never
    renders more than once per interval: the first request of an interval renders at once, later ones
    only replace the pending render, which a timer runs when the interval (or the budget) allows.
    """

    def __init__(self, hz: float, cost: int = 1, budget: MessageBudget = BUDGET,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.interval = 1.0 / hz
        self.cost = cost  # messages one render sends
        self.budget = budget
        self._loop = loop or asyncio.get_running_loop()
        self._pending: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._next = 0.0  # monotonic time before which no render may run
        self.renders = 0

    def request(self, render: Callable[[], None]) -> None:
        self._pending = render
        if self._timer is None:
            self._try()

    def flush(self, render: Callable[[], None] | None = None) -> None:
        """Renders now (the given render, else the pending one), ignoring the limits; cancels the timer."""
        self._cancel_timer()
        render, self._pending = render or self._pending, None
        if render is not None:
            self._run(render, time.monotonic())

    def close(self) -> None:
        self._cancel_timer()
        self._pending = None

    def _try(self) -> None:
        self._timer = None
        if self._pending is None:
            return
        now = time.monotonic()
        wait = max(self._next - now, self.budget.wait_time(self.cost, now))
        if wait > 0:
            self._timer = self._loop.call_later(wait, self._try)
            return
        render, self._pending = self._pending, None
        self._run(render, now)

    def _run(self, render: Callable[[], None], now: float) -> None:
        self._next = now + self.interval
        self.budget.take(self.cost, now)
        self.renders += 1
        render()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def max_in_window(times: list[float], window: float = 1.0) -> int:
    """The most events (given by their sorted times) in any `window` seconds: how tests and the
    benchmark check that the caps above hold."""
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] > window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best
