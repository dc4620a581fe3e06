"""The KV pool drawn as a grid: one cell per block, coloured by state and by the request that owns it.

The HTML stays small because it is resent a few times a second: cells are bare `<i>` elements, the
colours live in one `<style>` block (one rule per owning request), and pools larger than `MAX_CELLS`
blocks are drawn with several blocks per cell (the caption says how many), so the payload is bounded
whatever the pool size.

Readable at a glance: cells are 12 px; a used cell has its request's own saturated colour, a cached cell
(free, but still holding a reusable prefix) a dark hatch no request colour can be confused with, a free
cell a pale fill with an outline; the legend names each request drawn next to its colour.
"""
from __future__ import annotations

import itertools
import zlib
from collections import Counter

from pagednb.notebook.markdown import escape

MAX_CELLS = 2048
CELL_PX = 12
FREE_CSS = "background:#f5f5f5;box-shadow:inset 0 0 0 1px #b8b8b8"
CACHED_CSS = "background:repeating-linear-gradient(135deg,#334155 0 2px,#94a3b8 2px 4px)"
UNOWNED_CSS = "background:#555"
LEGEND_REQUESTS = 8  # requests named in the legend; the rest are counted
_uids = itertools.count()


def request_colour(request_id: str) -> str:
    """A colour that is stable for a request id across refreshes, views and kernels (crc32, not the
    salted built-in hash), saturated enough to stand apart from the pale free and hatched cached cells."""
    crc = zlib.crc32(request_id.encode())
    hue = (crc * 137.508) % 360  # golden-angle spread: consecutive ids get distant hues
    return f"hsl({hue:.0f},70%,{42 + crc % 3 * 6}%)"


def aggregate(blocks: list[tuple[str, str | None]], max_cells: int = MAX_CELLS) -> tuple[list[tuple[str, str | None]], int]:
    """Groups blocks so there are at most `max_cells` cells; a cell takes its blocks' most common
    state (ties go to used, then cached) and, if used, its most common owner. Returns (cells, group)."""
    group = max(1, -(-len(blocks) // max_cells))
    if group == 1:
        return blocks, 1
    cells = []
    rank = {"used": 2, "cached": 1, "free": 0}
    for start in range(0, len(blocks), group):
        chunk = blocks[start:start + group]
        states = Counter(state for state, _ in chunk)
        state = max(states, key=lambda s: (states[s], rank[s]))
        owner = Counter(o for s, o in chunk if s == "used").most_common(1)[0][0] if state == "used" else None
        cells.append((state, owner))
    return cells, group


class BlockMapRenderer:
    """Renders block maps for one view; its unique element id scopes the per-request colour rules."""

    def __init__(self, max_cells: int = MAX_CELLS) -> None:
        self.max_cells = max_cells
        self.dom_id = f"pagednb-map-{next(_uids)}"

    def render(self, blocks: list[tuple[str, str | None]]) -> str:
        cells, group = aggregate(blocks, self.max_cells)
        owners: dict[str, int] = {}
        parts = []
        for state, owner in cells:
            if state == "used" and owner is not None:
                k = owners.setdefault(owner, len(owners))
                parts.append(f'<i class="o{k}" title="block of request {escape(owner)}"></i>')
            elif state == "used":
                parts.append('<i class="u"></i>')
            elif state == "cached":
                parts.append('<i class="c"></i>')
            else:
                parts.append("<i></i>")
        return self._style(owners) + f'<div id="{self.dom_id}" class="pagednb-grid">{"".join(parts)}</div>' + \
            _caption(len(blocks), group, list(owners))

    def _style(self, owners: dict[str, int]) -> str:
        d = f"#{self.dom_id}"
        rules = [f"{d}{{display:flex;flex-wrap:wrap;gap:2px;max-width:100%}}",
                 f"{d} i{{display:block;width:{CELL_PX}px;height:{CELL_PX}px;border-radius:2px;{FREE_CSS}}}",
                 f"{d} i.c{{{CACHED_CSS}}}", f"{d} i.u{{{UNOWNED_CSS}}}"]
        rules += [f"{d} i.o{k}{{background:{request_colour(owner)};box-shadow:none}}" for owner, k in owners.items()]
        return "<style>" + "".join(rules) + "</style>"


def _swatch(css: str, label: str, cls: str = "") -> str:
    return (f'<span class="pagednb-legend-item{cls}" style="white-space:nowrap;margin-right:10px">'
            f'<span style="display:inline-block;width:{CELL_PX}px;height:{CELL_PX}px;border-radius:2px;'
            f'vertical-align:-2px;margin-right:4px;{css}"></span>{label}</span>')


def _caption(num_blocks: int, group: int, owners: list[str]) -> str:
    """The scale, then the legend: each request drawn, in its own colour, then cached and free."""
    scale = "one cell per block" if group == 1 else f"each cell shows {group} blocks (their most common state)"
    items = [_swatch(f"background:{request_colour(o)}", f"request {escape(o)}", " pagednb-legend-request")
             for o in owners[:LEGEND_REQUESTS]]
    if len(owners) > LEGEND_REQUESTS:
        items.append(f'<span style="margin-right:10px">+{len(owners) - LEGEND_REQUESTS} more requests</span>')
    if not owners:
        items.append('<span style="margin-right:10px">no request holds blocks</span>')
    items += [_swatch(CACHED_CSS, "cached (free, prefix kept)"), _swatch(FREE_CSS, "free")]
    return (f'<div class="pagednb-legend" style="font-size:12px;color:#333;margin-top:4px;line-height:20px">'
            f'{num_blocks:,} blocks, {scale}.<br>{"".join(items)}</div>')
