"""`pool_view()`: the KV cache pool, live — block counts, usage, requests, hit rate, tokens/s, block map.

A task on the running loop polls `llm.stats()` and `llm.block_map()` a few times a second and resends
only the widgets whose content changed, so an idle engine costs no messages. The block map is the
expensive part on big pools; its refresh is spaced so that drawing it takes at most ~5% of the loop.

The view always ends on the truth: the refresh that sees the engine go idle redraws the block map too
(however its spacing stands), and `stop()` draws the final state before it ends the task. Without that,
"Run All" of a notebook that stops the view right after its last requests finish froze the view
mid-run (`used 30 · running 6`) above a `llm.stats()` that showed 0.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import ipywidgets as widgets

from pagednb.notebook.display import Displayable
from pagednb.notebook.block_map import BlockMapRenderer
from pagednb.notebook.throttle import BUDGET

MIN_HZ, MAX_HZ = 0.5, 5.0
MAP_DUTY = 0.05  # the block map may use this fraction of the loop's time
RATE_WINDOW_S = 2.0  # tokens/s is averaged over this window


class PoolView(Displayable):
    """The pool gauges and block map of one LLM."""

    def __init__(self, llm, refresh_hz: float = 4.0) -> None:
        self._llm = llm
        self.interval = 1.0 / min(max(refresh_hz, MIN_HZ), MAX_HZ)
        self._map = BlockMapRenderer()
        self._samples: deque[tuple[float, int]] = deque()  # (time, generated_tokens)
        self._map_cost = 0.0
        self._map_due = 0.0
        self._was_idle = True

        self.used = widgets.Label(_dom_classes=["pagednb-pool-used"])
        self.usage_bar = widgets.FloatProgress(min=0.0, max=1.0, description="KV usage",
                                               layout=widgets.Layout(width="320px"),
                                               _dom_classes=["pagednb-pool-usage"])
        self.activity = widgets.Label(_dom_classes=["pagednb-pool-activity"])
        self.block_map = widgets.HTML(_dom_classes=["pagednb-block-map"])
        self.widget = widgets.VBox([widgets.HBox([self.usage_bar, self.used]), self.activity, self.block_map],
                                   _dom_classes=["pagednb-pool"])

        self.refresh()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._loop_thread = threading.get_ident()
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # a script without an event loop: a snapshot, refreshed by hand
            return
        self._task = self._loop.create_task(self._run(), name="pagednb-pool-view")

    # ---- control -------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Redraws everything now (block map included). Call on the loop's thread (a cell)."""
        self._update(force_map=True)

    def stop(self) -> None:
        """Ends live updates (safe from any thread) after drawing the final state, which the widgets keep."""
        task, loop = self._task, self._loop
        if task is None or loop is None or task.done():
            return
        if threading.get_ident() == self._loop_thread:
            self._final_refresh(task)
        else:
            loop.call_soon_threadsafe(self._final_refresh, task)

    def _final_refresh(self, task: asyncio.Task) -> None:
        task.cancel()
        try:
            self.refresh()
        except Exception as error:  # e.g. the engine is already closed: keep what was drawn, say why
            self.activity.value = f"pool view stopped: {error!r}"

    @property
    def live(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self._update(force_map=False)
            except Exception as error:  # e.g. llm.close(): nothing left to watch
                self.activity.value = f"pool view stopped: {error!r}"
                return

    # ---- one refresh --------------------------------------------------------------------------------
    def _update(self, force_map: bool) -> None:
        now = time.monotonic()
        stats = self._llm.stats()
        self._samples.append((now, stats["generated_tokens"]))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()
        self._set(self.used, "value", used_line(stats))
        self._set(self.usage_bar, "value", round(stats["kv_usage"], 4))
        idle = stats["running"] == 0 and stats["waiting"] == 0
        self._set(self.activity, "value", activity_line(stats, 0.0 if idle else self.tokens_per_s()))
        went_idle, self._was_idle = idle and not self._was_idle, idle
        if force_map or went_idle or now >= self._map_due:
            start = time.perf_counter()
            html = self._map.render(self._llm.block_map())
            self._map_cost = time.perf_counter() - start
            self._map_due = now + max(self.interval, self._map_cost / MAP_DUTY) - 0.01
            self._set(self.block_map, "value", html)

    def tokens_per_s(self) -> float:
        (t0, g0), (t1, g1) = self._samples[0], self._samples[-1]
        return (g1 - g0) / (t1 - t0) if t1 > t0 else 0.0

    @staticmethod
    def _set(widget: widgets.Widget, name: str, value) -> None:
        """Sends a trait only when it changed: an idle pool costs no messages."""
        if getattr(widget, name) != value:
            BUDGET.take(1)
            setattr(widget, name, value)


def used_line(s: dict) -> str:
    """'used 12 · free 244 (3 cached) of 256 blocks × 16 tokens · 4.7%'"""
    return (f"used {s['used_blocks']} · free {s['free_blocks']} ({s['cached_blocks']} cached) of "
            f"{s['num_blocks']} blocks × {s['block_size']} tokens · {s['kv_usage'] * 100:.1f}%")


def activity_line(s: dict, tokens_per_s: float) -> str:
    """'running 2 · waiting 0 · preemptions 0 · prefix-cache hits 43% of 1,024 tokens · 310 tok/s'"""
    query = s["prefix_cache_query_tokens"]
    hits = f"{s['prefix_cache_hit_tokens'] / query * 100:.0f}% of {query:,} tokens" if query else "— (no queries yet)"
    return (f"running {s['running']} · waiting {s['waiting']} · preemptions {s['preemptions']} · "
            f"prefix-cache hits {hits} · {tokens_per_s:.0f} tok/s")


def pool_view(llm, refresh_hz: float = 4.0, *, display: bool = True) -> PoolView:
    """Shows the KV pool live (refreshed at `refresh_hz`, 0.5-5 Hz) until `view.stop()`."""
    view = PoolView(llm, refresh_hz)
    if display:
        view.show()
    return view
