"""Showing a view once: `stream(...)` displays its widget, and when the call is also the cell's last
expression IPython would show the returned handle a second time. Views therefore display themselves
through `_ipython_display_`, which does nothing in the cell that already showed them, and shows the
live widget again when the handle is evaluated in a later cell."""
from __future__ import annotations

import ipywidgets as widgets


def _cell_number() -> int | None:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return None if shell is None else shell.execution_count


class Displayable:
    widget: widgets.Widget
    _shown_in_cell: int | None = None

    def show(self) -> None:
        """Displays the view's widget in the current cell's output."""
        from IPython.display import display
        display(self.widget)
        self._shown_in_cell = _cell_number()

    def _ipython_display_(self) -> None:
        if self._shown_in_cell is None or self._shown_in_cell != _cell_number():
            self.show()
