"""The pagednb engines alive in this process, and the device memory each one holds.

In a notebook, re-running `llm = LLM(...)` builds the new engine while the old one still holds its
weights and KV cache (the name is only rebound once the new one exists; Out[...] may keep it too).
Device-wide counters cannot tell that memory from the new engine's own, so the start-up report would
call it "weights". Each engine therefore registers what it holds here, and the KV-cache sizing names
the others ("close() them to free it") in its report and in a refusal to start.

The registry holds engines weakly: an engine that is garbage-collected drops out on its own, and
`close()` removes it at once. Process-wide on purpose: engines do not know about each other otherwise.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

GiB = 2**30


@dataclass(frozen=True)
class EngineMemory:
    """What one engine holds on its device."""
    model: str
    device: str
    weights_bytes: int
    kv_cache_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes


_lock = threading.Lock()
_engines: weakref.WeakKeyDictionary[object, EngineMemory] = weakref.WeakKeyDictionary()


def device_key(device: torch.device | str) -> str:
    """"cuda" and "cuda:0" are one device when 0 is the current one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors)


def parameter_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's own parameters (tied ones once): what "weights" means in the reports,
    measured on the tensors rather than as a difference of device-wide counters."""
    return tensor_bytes(model.parameters())


def register(engine: object, model: str | os.PathLike, device: torch.device | str, weights_bytes: int,
             kv_cache_bytes: int) -> None:
    """`model` as the user gave it: a hub id or a folder, shown by its last part ("Qwen3-0.6B")."""
    name = os.path.basename(os.fspath(model).rstrip("/\\")) or os.fspath(model)
    with _lock:
        _engines[engine] = EngineMemory(name, device_key(device), weights_bytes, kv_cache_bytes)


def unregister(engine: object) -> None:
    with _lock:
        _engines.pop(engine, None)


def memory_of(engine: object) -> EngineMemory | None:
    """What `engine` registered; None once it is closed or collected."""
    with _lock:
        return _engines.get(engine)


def on_device(device: torch.device | str | None = None) -> list[EngineMemory]:
    """The registered engines (on `device` if given)."""
    key = None if device is None else device_key(device)
    with _lock:
        entries = list(_engines.values())
    return [memory for memory in entries if key is None or memory.device == key]


def describe(engines: list[EngineMemory]) -> str:
    """"other pagednb engines in this process hold 3.10 GiB on cuda:0 (Qwen3-0.6B: 1.50 GiB, ...): close()
    them (llm.close()) to free it", or "" when there are none."""
    if not engines:
        return ""
    total = sum(e.total_bytes for e in engines)
    each = ", ".join(f"{e.model}: {format_bytes(e.total_bytes)}" for e in engines)
    where = engines[0].device if len({e.device for e in engines}) == 1 else "their devices"
    return (f"other pagednb engines in this process hold {format_bytes(total)} on {where} ({each}): "
            f"close() them (llm.close()) to free it")


def format_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / 2**20:.2f} MiB"
