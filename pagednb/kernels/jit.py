"""Builds and loads pagednb's CUDA kernels (`kernels_cuda/`) once per process.

`torch.utils.cpp_extension.load` compiles the sources for the GPU present (`-gencode` from its
compute capability: sm_90 on an H100/H200) into TORCH_EXTENSIONS_DIR (pagednb sets
~/.cache/pagednb/torch_extensions when it is unset), so a second start only loads the cached library.
The extension name carries a hash of every source and header, so an edited kernel rebuilds. A cold
build shows a progress line with the elapsed time (notebook or terminal).

The library exposes a small C ABI (kernels_cuda/bindings.cpp); abi.py declares its signatures on the
library as it loads. When there is no CUDA device, no nvcc, or the build fails, `load_kernels()` returns
None and emits one warning that says why; the engine then runs the pure-torch reference paths.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from pagednb.kernels.abi import declare

logger = logging.getLogger("pagednb")

SOURCES = ["bindings.cpp", "cache_write.cu", "decode.cu", "decode_hd16.cu", "decode_hd32.cu", "decode_hd64.cu",
           "decode_hd128.cu", "decode_hd256.cu", "prefill_f16.cu", "prefill_bf16.cu", "fused_ops.cu", "sampling.cu",
           "gemv.cu", "moe.cu"]
_lock = threading.Lock()
_state: dict = {"tried": False, "lib": None, "error": None}


def kernels_dir() -> Path:
    """The kernel sources: $PAGEDNB_KERNELS_DIR, else kernels_cuda/ of a source checkout, else the copy
    a wheel carries as pagednb/_kernels_cuda."""
    env = os.environ.get("PAGEDNB_KERNELS_DIR")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parents[2] / "kernels_cuda"  # pagednb/kernels/jit.py -> the repo
    return checkout if checkout.is_dir() else Path(__file__).resolve().parents[1] / "_kernels_cuda"


def unavailable_reason() -> str | None:
    """Why the kernels cannot be built here, or None if they may be."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.version.cuda is None:
        return "this torch build has no CUDA support"
    from torch.utils import cpp_extension
    home = cpp_extension.CUDA_HOME
    nvcc = Path(home, "bin", "nvcc") if home else None
    if not (nvcc and nvcc.exists()) and shutil.which("nvcc") is None:
        return "nvcc (the CUDA compiler) was not found; set CUDA_HOME"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the pip package puts the binary on sys.path's scripts)
        except ImportError:
            return "ninja was not found (pip install ninja)"
    src = kernels_dir()
    missing = [s for s in SOURCES if not (src / s).exists()]
    if missing:
        return f"kernel sources not found in {src} ({', '.join(missing)})"
    return None


def load_kernels(quiet: bool = False) -> ctypes.CDLL | None:
    """The compiled kernel library (memoised), or None with one warning saying why."""
    with _lock:
        if _state["tried"]:
            return _state["lib"]
        _state["tried"] = True
        try:
            reason = unavailable_reason()
            if reason is None:
                _state["lib"] = _build_and_load(quiet)
            else:
                _state["error"] = reason
        except Exception as exc:  # a failed build or load: fall back, say why
            msg = str(exc).strip().splitlines()
            _state["error"] = f"the build failed: {msg[-1] if msg else type(exc).__name__}"
            logger.debug("CUDA kernel build failed", exc_info=True)
        if _state["lib"] is None:
            warnings.warn(f"pagednb: CUDA attention kernels unavailable ({_state['error']}); "
                          "using the pure-torch reference attention backend", RuntimeWarning, stacklevel=2)
        return _state["lib"]


def load_error() -> str | None:
    """Why the last load_kernels() returned None."""
    return _state["error"]


def _source_hash(src: Path) -> str:
    h = hashlib.sha1()
    for f in sorted(src.iterdir()):
        if f.suffix in (".cu", ".cuh", ".h", ".cpp"):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:10]


def _build_and_load(quiet: bool) -> ctypes.CDLL:
    from torch.utils import cpp_extension

    os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                          str(Path.home() / ".cache" / "pagednb" / "torch_extensions"))
    major, minor = torch.cuda.get_device_capability()
    cc = f"{major}{minor}"
    src = kernels_dir()
    name = f"pagednb_kernels_sm{cc}_{_source_hash(src)}"
    build_dir = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / name
    lib_path = build_dir / f"{name}.so"
    cold = not lib_path.exists()
    cuda_flags = [f"-gencode=arch=compute_{cc},code=sm_{cc}", "-O3", "-std=c++17", "--expt-relaxed-constexpr"]
    progress = _Progress("compiling CUDA kernels (first use, ~1 min)") if cold and not quiet else None
    t0 = time.perf_counter()
    try:
        path = cpp_extension.load(
            name=name, sources=[str(src / s) for s in SOURCES], extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=cuda_flags, extra_include_paths=[str(src)], is_python_module=False,
            verbose=False)
    finally:
        if progress is not None:
            progress.close()
    lib = ctypes.CDLL(str(path))
    declare(lib)
    if cold:
        logger.info("CUDA kernels compiled in %.1f s (cached in %s)", time.perf_counter() - t0, build_dir)
    return lib


class _Progress:
    """A one-line progress display with the elapsed time while a cold build runs (tqdm: notebook or
    terminal); it logs the start and the end too, so a log file has both."""

    def __init__(self, message: str) -> None:
        logger.warning("%s…", message)
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        try:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=None, desc=message, bar_format="{desc}: {elapsed}", file=sys.stderr)
        except Exception:  # no tqdm: the log lines alone
            self._bar = None
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            if self._bar is not None:
                self._bar.refresh()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._bar is not None:
            self._bar.close()
        logger.warning("CUDA kernels: build finished after %.0f s", time.perf_counter() - self._t0)
