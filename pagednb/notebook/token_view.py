"""The token view: a reply drawn token by token, coloured by the probability the model gave each token;
hovering one shows the top-k alternatives at that position (the engine's vLLM-style logprobs).

It is an anywidget (the JavaScript is static/token_view.js), so it renders wherever anywidget does:
JupyterLab, Notebook 7, VS Code, Colab, marimo. The stream and chat views create one only when their
"Token probabilities" toggle is first pressed (or the view is opened with `token_view=True`), and feed
it through the same throttle as their text, so a reply nobody looks at token by token costs no messages
at all (nor logprobs in the engine: stream_view.py).

A reply only grows, so an update sends only the rows of the new tokens (one custom message); a synced
trait would resend, JSON-encode and compare the whole reply, with its alternatives, on every update. A
newly drawn view asks for all the rows once.
"""
from __future__ import annotations

import asyncio
import math
from pathlib import Path

import anywidget
import traitlets

from pagednb.notebook.throttle import BUDGET
from pagednb.outputs import CompletionOutput, Logprob

STATIC = Path(__file__).parent / "static"
# Alternatives shown on hover when the caller's SamplingParams did not ask for logprobs themselves.
DEFAULT_TOP_K = 5

# One row per generated token: [text, probability, rank, [[text, probability, rank], ...]].
TokenRow = list


class TokenView(anywidget.AnyWidget):
    """The widget. `rows` holds what it shows; `update()` appends a completion's new tokens."""

    _esm = STATIC / "token_view.js"
    _css = STATIC / "token_view.css"
    box_css = traitlets.Unicode("").tag(sync=True)  # the reply's own style (a chat bubble)

    def __init__(self, box_css: str = "", loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(box_css=box_css, _dom_classes=["pagednb-token-view"])
        self.rows: list[TokenRow] = []
        self._loop = loop  # where sends happen: a browser's request may arrive on another thread
        self.on_msg(self._on_browser_message)

    def update(self, completion: CompletionOutput | None) -> None:
        """Converts the completion's positions not shown yet (cumulative outputs repeat the earlier
        ones unchanged) and sends just those, in one message. Call on the loop's thread."""
        positions = completion.logprobs if completion is not None and completion.logprobs else []
        start = len(self.rows)
        new = [token_row(completion.token_ids[i], positions[i]) for i in range(start, len(positions))]
        if new:
            self.rows.extend(new)
            self.send({"start": start, "rows": new})

    def _on_browser_message(self, _widget, content: dict, _buffers) -> None:
        if content.get("want") == "all":  # a view just drawn (or one that missed a message)
            if self._loop is None:
                self._send_all()
            else:
                self._loop.call_soon_threadsafe(self._send_all)

    def _send_all(self) -> None:
        BUDGET.take(1)
        self.send({"start": 0, "rows": self.rows})


def token_row(token_id: int, position: dict[int, Logprob]) -> TokenRow:
    """The chosen token's text, probability and rank, with the position's alternatives by rank."""
    chosen = position[token_id]
    alternatives = sorted(position.items(), key=lambda item: item[1].rank or 0)
    return [_text(token_id, chosen), _probability(chosen), chosen.rank,
            [[_text(tid, lp), _probability(lp), lp.rank] for tid, lp in alternatives]]


def _text(token_id: int, logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else f"<{token_id}>"


def _probability(logprob: Logprob) -> float:
    return round(math.exp(logprob.logprob), 5) if math.isfinite(logprob.logprob) else 0.0
