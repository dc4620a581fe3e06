"""Moves a step's small host-built tensors (sampling parameters, token indices) to the device
without making the host wait for the GPU.

A tensor made from a Python list and copied from ordinary (pageable) memory makes the host wait until
the copy is done, i.e. until the work queued before it (the forward pass) finishes. Staged through
pinned memory the copies are asynchronous, so the next inputs are built while the GPU runs the model.
Two pinned buffers alternate by step: with one step in flight while the next is prepared, the buffer a
step fills was last used two steps ago, and its copies are waited for (an event) before it is rewritten.
Lists that do not fit go the ordinary way.
"""
from __future__ import annotations

import torch


class PinnedStager:
    def __init__(self, device: torch.device, capacity_bytes: int = 1 << 20) -> None:
        self.device = device
        self.enabled = device.type == "cuda"
        size = capacity_bytes if self.enabled else 0
        self._buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=self.enabled) for _ in range(2)]
        self._copied = [torch.cuda.Event() if self.enabled else None for _ in range(2)]
        self._current = 0
        self._used = 0

    def next_step(self) -> None:
        """Switches to the other buffer for a new step; waits for that buffer's last copies."""
        if not self.enabled:
            return
        self._copied[self._current].record()
        self._current ^= 1
        self._copied[self._current].synchronize()
        self._used = 0

    def tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        size = dtype.itemsize
        start = -(-self._used // 8) * 8
        end = start + len(values) * size
        buffer = self._buffers[self._current]
        if not self.enabled or not values or end > buffer.numel():
            return torch.tensor(values, dtype=dtype, device=self.device)
        host = buffer[start:end].view(dtype)
        host.numpy()[:] = values
        self._used = end
        return host.to(self.device, non_blocking=True)
