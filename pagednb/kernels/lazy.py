"""One kernel wrapper per process, made on first use: the factory behind the fused ops, the GEMV and the
sampling kernel.

Each of those modules keeps a `LazyKernel(TheirWrapper)`. Its ops ask `enabled()` on every call (cheap
once memoised) and run their torch reference when it answers None; tests and benchmarks ask `get()` for
the wrapper whatever the switch says. PAGEDNB_FUSED_OPS=0 turns these kernels off (attention is
unaffected); it is read once per process, and while it is off the library is never looked up.
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Callable, Generic, TypeVar

from pagednb.kernels.jit import load_kernels

K = TypeVar("K")


class LazyKernel(Generic[K]):
    """`wrap(library)` made once, on first use."""

    def __init__(self, wrap: Callable[[ctypes.CDLL], K]) -> None:
        self._wrap = wrap
        self.get: Callable[[], K | None] = functools.cache(self._make)
        self.enabled: Callable[[], K | None] = functools.cache(self._make_enabled)

    def _make(self) -> K | None:
        """The wrapper, or None where the library is unavailable (jit.load_error() says why)."""
        lib = load_kernels()
        return None if lib is None else self._wrap(lib)

    def _make_enabled(self) -> K | None:
        """get(), unless PAGEDNB_FUSED_OPS=0."""
        return None if _switched_off() else self.get()


def _switched_off() -> bool:
    return os.environ.get("PAGEDNB_FUSED_OPS", "1").strip() == "0"
