"""Sleep mode: the model's weights leave the device (and the KV pool is freed) while the engine is idle,
so the GPU serves the user's other work in the same kernel; waking up puts everything back.

As in vLLM (`LLM.sleep` / `LLM.wake_up`):
  * level 1 copies the weights to CPU memory (pinned on a GPU, so waking is one fast copy back);
  * level 2 drops them, and waking reloads them from the checkpoint (the same safetensors files).
Buffers that no checkpoint holds (the RoPE cos/sin table) are copied to the CPU at both levels, as
vLLM does. Every tensor keeps its Parameter object, only its storage is swapped (`.data`), so modules
and tied weights (an LM head sharing the embedding) stay wired as built. The KV pool holds nothing
worth keeping while idle: it is freed at both levels and allocated anew, same size, on waking.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagednb.model.loader import load_weights, safetensors_files

SLEEP_LEVELS = {1: "weights to CPU memory, KV pool freed", 2: "weights and KV pool freed, reloaded on wake"}


@dataclass
class SleepingWeights:
    """What a sleeping model needs to wake: CPU copies (level 1: every tensor; level 2: buffers only)
    and, for dropped parameters, their shapes."""

    level: int
    copies: dict[str, torch.Tensor] = field(default_factory=dict)
    dropped: dict[str, torch.Size] = field(default_factory=dict)


def put_to_sleep(model: torch.nn.Module, level: int) -> SleepingWeights:
    """Moves the model's tensors off the device (level 1) or drops its parameters (level 2)."""
    device = _device_of(model)
    state = SleepingWeights(level)
    for name, tensor in _tensors(model, level):
        state.copies[name] = _cpu_copy(tensor, pin=device.type == "cuda")
        tensor.data = _empty(tensor)
    if level == 2:
        for name, param in model.named_parameters():
            state.dropped[name] = param.shape
            param.data = _empty(param)
    return state


def wake(model: torch.nn.Module, state: SleepingWeights, device: torch.device, checkpoint: Path) -> None:
    """Puts every tensor back on `device`, in its dtype; level 2 reloads the parameters from `checkpoint`."""
    if state.level == 2:
        params = dict(model.named_parameters())
        for name, shape in state.dropped.items():
            params[name].data = torch.empty(shape, dtype=params[name].dtype, device=device)
        load_weights(model, safetensors_files(checkpoint))
    tensors = dict(_named_tensors(model))
    for name, copy in state.copies.items():
        tensors[name].data = copy.to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the pinned copies may be freed once this returns


def _tensors(model: torch.nn.Module, level: int):
    """What is copied to the CPU: buffers always, parameters at level 1."""
    return list(model.named_buffers()) + (list(model.named_parameters()) if level == 1 else [])


def _named_tensors(model: torch.nn.Module):
    yield from model.named_parameters()
    yield from model.named_buffers()


def _cpu_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    copy.copy_(tensor.detach())
    return copy


def _empty(tensor: torch.Tensor) -> torch.Tensor:
    """A zero-element stand-in on the same device and dtype: the old storage is freed with its last user."""
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
