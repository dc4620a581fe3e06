"""`AutoScroll`: an invisible anywidget that keeps a scrolling box of a view at its bottom as content
arrives (the chat history follows a streaming reply). ipywidgets has no way to scroll from Python, and
scrolling from the kernel would cost a message per token; the browser does it by itself
(static/autoscroll.js), for free, wherever anywidget runs."""
from __future__ import annotations

import anywidget
import traitlets

from pagednb.notebook.token_view import STATIC


class AutoScroll(anywidget.AnyWidget):
    """Follows the element with class `target` inside the nearest ancestor with class `container`
    (put this widget inside that container)."""

    _esm = STATIC / "autoscroll.js"
    container = traitlets.Unicode().tag(sync=True)
    target = traitlets.Unicode().tag(sync=True)
