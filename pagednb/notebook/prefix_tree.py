"""`prefix_tree(llm)`: the prefix cache as a tree of shared prefixes, live.

Each node is one cached block: its token text on hover, how many requests hold it, and its place in the
eviction order among the cached blocks (1 = the first to be evicted). Data: `llm.prefix_cache_snapshot()`. A snapshot
walks the whole pool and a refresh resends the tree (~3 ms in all for 1,000 blocks, 180 of them cached,
measured with 8 streams), so while the engine runs the view refreshes twice a second (4 Hz took 1.4-1.7%
of the loop), and less often when a refresh costs more than 1% of the loop: the views together must stay
under 5% (benchmarks/widget_overhead.py). When the engine goes idle it draws the final state once and
then costs nothing.
An anywidget (static/prefix_tree.js).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import anywidget
import traitlets

from pagednb.engine.prefix_cache_snapshot import PrefixCacheSnapshot
from pagednb.notebook.display import Displayable
from pagednb.notebook.throttle import BUDGET

STATIC = Path(__file__).parent / "static"
MAX_HZ = 2.0
IDLE_POLL_S = 0.25  # how often an idle engine is checked for new work (a cheap question)
DUTY = 0.01  # the view may use this fraction of the loop's time
MAX_NODES = 400  # drawn at most (the shallowest first: the shared prefixes are what matters)


class PrefixTreeWidget(anywidget.AnyWidget):
    _esm = STATIC / "prefix_tree.js"
    _css = STATIC / "prefix_tree.css"
    tree = traitlets.Dict().tag(sync=True)


class PrefixTreeView(Displayable):
    def __init__(self, llm) -> None:
        self._llm = llm
        self._texts: dict[tuple[int, ...], str] = {}  # decoded block text, by tokens
        self.widget = PrefixTreeWidget()
        self.snapshot: PrefixCacheSnapshot | None = None
        self.refresh()
        self._task: asyncio.Task | None = None
        try:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pagednb-prefix-tree")
        except RuntimeError:  # no event loop (a script): a snapshot, refreshed by hand
            pass

    def refresh(self) -> None:
        """Draws the cache as it is now (sends nothing when nothing changed)."""
        self.snapshot = self._llm.prefix_cache_snapshot()
        tree = tree_json(self.snapshot, self._text)
        if tree != self.widget.tree:
            BUDGET.take(1)
            self.widget.tree = tree

    def stop(self) -> None:
        """Ends live updates after drawing the final state."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self.refresh()

    @property
    def live(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        busy = False
        while True:
            engine = self._llm.engine
            if engine.closed:
                return
            was_busy, busy = busy, engine.has_unfinished_requests()
            if not busy and not was_busy:
                await asyncio.sleep(IDLE_POLL_S)
                continue
            start = time.perf_counter()
            self.refresh()  # the last one of a run (busy -> idle) draws the final state
            cost = time.perf_counter() - start
            await asyncio.sleep(max(1.0 / MAX_HZ, cost / DUTY))

    def _text(self, token_ids: tuple[int, ...]) -> str:
        text = self._texts.get(token_ids)
        if text is None:
            text = self._texts[token_ids] = self._llm.engine.tokenizer.decode(list(token_ids))
        return text


def tree_json(snapshot: PrefixCacheSnapshot, text_of: Callable[[tuple[int, ...]], str]) -> dict:
    """The snapshot as the widget draws it: nodes [id, parent, text, ref_cnt, eviction order, reachable]
    (parents first), cut to MAX_NODES. The eviction order counts cached blocks only (1 = the first cached
    block to go): the pool's own rank moves with every block handed out, which would resend the tree at
    every allocation while the order of the cached blocks, what the tree is about, stays put."""
    order = {block_id: i for i, block_id in enumerate(snapshot.eviction_order(), start=1)}
    nodes = snapshot.nodes[:MAX_NODES]
    return {"block_size": snapshot.block_size, "num_blocks": snapshot.num_blocks, "num_free": snapshot.num_free,
            "num_cached": len(snapshot.nodes), "shown": len(nodes),
            "nodes": [[n.block_id, n.parent_id, text_of(n.token_ids), n.ref_cnt, order.get(n.block_id), n.reachable]
                      for n in nodes]}


def prefix_tree(llm, *, display: bool = True) -> PrefixTreeView:
    """Shows the prefix cache of `llm` as a tree, live while the engine runs, until `view.stop()`."""
    view = PrefixTreeView(llm)
    if display:
        view.show()
    return view
