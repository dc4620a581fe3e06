"""The KV pool drawn as a grid: one cell per block, coloured by state and by the request that owns it.

The HTML stays small because it is resent a few times a second: cells are bare `<i>` elements, the
colours live in one `<style>` block (one rule per owning request), and pools larger than `MAX_CELLS`
blocks are drawn with several blocks per cell (the caption says how many), so the payload is bounded
whatever the pool size.
"""
from __future__ import annotations

import itertools
import zlib
from collections import Counter

from pagednb.notebook.markdown import escape

MAX_CELLS = 2048
FREE_COLOUR = "#e8e8e8"
CACHED_COLOUR = "#b9c7d6"  # free, but still holding a reusable prefix
_uids = itertools.count()


def request_colour(request_id: str) -> str:
    """A colour that is stable for a request id across refreshes, views and kernels (crc32, not the
    salted built-in hash), saturated enough to stand apart from the grey free/cached cells."""
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
            self._caption(len(blocks), group)

    def _style(self, owners: dict[str, int]) -> str:
        d = f"#{self.dom_id}"
        rules = [f"{d}{{display:flex;flex-wrap:wrap;gap:1px;max-width:100%}}",
                 f"{d} i{{display:block;width:7px;height:7px;background:{FREE_COLOUR}}}",
                 f"{d} i.c{{background:{CACHED_COLOUR}}}", f"{d} i.u{{background:#555}}"]
        rules += [f"{d} i.o{k}{{background:{request_colour(owner)}}}" for owner, k in owners.items()]
        return "<style>" + "".join(rules) + "</style>"

    @staticmethod
    def _caption(num_blocks: int, group: int) -> str:
        scale = "one cell per block" if group == 1 else \
            f"each cell shows {group} blocks (their most common state)"
        swatch = '<span style="display:inline-block;width:9px;height:9px;background:{};margin:0 3px 0 8px"></span>'
        legend = (swatch.format("hsl(200,70%,48%)") + "used (a colour per request)" +
                  swatch.format(CACHED_COLOUR) + "cached (free, prefix kept)" + swatch.format(FREE_COLOUR) + "free")
        return f'<div style="font-size:11px;color:#666;margin-top:3px">{num_blocks:,} blocks, {scale}.{legend}</div>'
