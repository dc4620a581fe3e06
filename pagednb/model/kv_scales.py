"""A checkpoint's per-layer KV cache scales (FP8 checkpoints quantised by llm-compressor / ModelOpt), as vLLM
reads them: `model.layers.N.self_attn.k_scale` and `.v_scale`, or the older `...k_proj.output_scale` and
`...v_proj.output_scale`. Each is a one-element tensor: the layer's K (or V) is stored in an fp8 cache as
fp8(x / scale) (attention/kv_quant.py). They set plain floats on the layer's attention, used only when the
KV cache is fp8; without them the scale is 1.0, vLLM's default.
"""
from __future__ import annotations

import re

import torch

from pagednb.model.decoder import CausalLM

_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")


def is_kv_scale(name: str) -> bool:
    return _SCALE_NAME.match(name) is not None


def load_kv_scale(model: CausalLM, name: str, tensor: torch.Tensor) -> None:
    """Sets the scale a checkpoint tensor named `name` (is_kv_scale) carries; refuses a scale that is not one
    positive finite number (it would store infinities or NaNs in the cache)."""
    match = _SCALE_NAME.match(name)
    layer, which = int(match.group(1)), match.group(2) or match.group(3)
    layers = model.model.layers
    if layer >= len(layers):
        raise ValueError(f"checkpoint tensor {name!r} names layer {layer}; the model has {len(layers)} layers")
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {name!r} must hold one KV cache scale, got shape {tuple(tensor.shape)}")
    scale = float(tensor.float().item())
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale must be a positive finite number, got {scale}")
    setattr(layers[layer].self_attn, f"{which}_scale", scale)
