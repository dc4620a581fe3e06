"""Which attention backend the engine uses on a device."""
from __future__ import annotations

import torch

from pagednb.attention.backend import AttentionBackend
from pagednb.attention.torch_ref import TorchReferenceBackend

BACKENDS = ("auto", "torch_ref")


def select_attention_backend(device: torch.device, name: str = "auto") -> AttentionBackend:
    """"auto": the fastest backend that works on `device`; a name forces that backend."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    return TorchReferenceBackend()
