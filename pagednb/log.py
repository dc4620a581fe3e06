"""Where the engine's log lines go: what it decided (model load, pool size) said once, in a way that
fits where it runs.

A terminal or a script gets today's behaviour: `[pagednb] ...` lines on stderr. In a Jupyter kernel,
stderr is drawn as pink boxes that read as errors, so the same lines go to stdout instead, where they
show as ordinary cell output. Either way the handler is added only when the user has not set up the
"pagednb" logger themselves, and `set_log_level("WARNING")` quiets it (`"INFO"` turns it back on).
"""
from __future__ import annotations

import logging
import sys

LOGGER_NAME = "pagednb"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _StdoutHandler(logging.StreamHandler):
    """Writes to the `sys.stdout` of the moment: ipykernel swaps it for its own stream after pagednb
    may already have been imported, and a handler bound at import would write past the notebook."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ assigns it; the property always reads the live one
        pass


def in_jupyter_kernel() -> bool:
    """True inside a Jupyter kernel (ipykernel's shell), False in a terminal, a script or plain IPython."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def configure_default_logging() -> None:
    """Gives the "pagednb" logger its default handler at INFO, unless the user already configured it."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.handlers:
        return
    handler = _StdoutHandler() if in_jupyter_kernel() else logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[pagednb] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def set_log_level(level: str | int) -> None:
    """How much the engine says: "INFO" (the default: start-up decisions), "WARNING" (problems only),
    "DEBUG", "ERROR" or "CRITICAL", or a `logging` level number."""
    if isinstance(level, bool) or not isinstance(level, (str, int)):
        raise TypeError(f"level must be one of {LEVELS} or a logging level int, got {type(level).__name__}")
    if isinstance(level, str):
        if level.upper() not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS} (any case), got {level!r}")
        level = getattr(logging, level.upper())
    logging.getLogger(LOGGER_NAME).setLevel(level)
