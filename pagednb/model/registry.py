"""The architectures pagednb runs: one table from the HF architecture name to all that differs per
architecture (mini-sglang's model registry).

Adding an architecture is one decoder flavour (decoder.py) plus one entry in SUPPORTED_ARCHITECTURES;
nothing else in pagednb names architectures. The engine builds a model's ModelSpec here once
(model_spec) and hands it to the loader, which builds the decoder here too (build_model).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagednb.attention.backend import AttentionBackend
from pagednb.model.decoder import (CausalLM, DecoderFlavor, gemma2_flavor, gemma3_flavor, granite_flavor,
                                   llama_flavor, mixtral_flavor, olmo2_flavor, phi3_flavor, qwen2_flavor,
                                   qwen3_flavor, qwen3_moe_flavor)
from pagednb.model.spec import ModelSpec, check_hf_config

SlidingWindows = tuple[int | None, ...]  # one per layer; None = full attention


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture is not one pagednb implements."""


def no_sliding_windows(cfg) -> SlidingWindows:
    return (None,) * cfg.num_hidden_layers


def mistral_sliding_windows(cfg) -> SlidingWindows:
    """Mistral and Phi-3 apply their sliding_window (when set) to every layer."""
    return (getattr(cfg, "sliding_window", None),) * cfg.num_hidden_layers


def qwen_sliding_windows(cfg) -> SlidingWindows:
    """Qwen2/3 slide only when use_sliding_window is on, and only in layers typed so."""
    window = getattr(cfg, "sliding_window", None)
    if not getattr(cfg, "use_sliding_window", False) or window is None:
        return no_sliding_windows(cfg)
    layer_types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def layer_type_sliding_windows(cfg) -> SlidingWindows:
    """Gemma 2/3: the layers typed "sliding_attention" slide (Gemma 2: every other one, from the first;
    Gemma 3: five in six, from its sliding_window_pattern); HF's config writes layer_types out."""
    window = getattr(cfg, "sliding_window", None)
    if window is None:
        return no_sliding_windows(cfg)
    return tuple(window if t == "sliding_attention" else None for t in cfg.layer_types)


@dataclass(frozen=True)
class Architecture:
    """What pagednb needs to know about one architecture, each read from the model's HF config."""

    flavor: Callable[[object], DecoderFlavor]  # the decoder's switches
    sliding_windows: Callable[[object], SlidingWindows]  # which layers attend through a window


SUPPORTED_ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(llama_flavor, no_sliding_windows),
    "MistralForCausalLM": Architecture(llama_flavor, mistral_sliding_windows),
    "Qwen2ForCausalLM": Architecture(qwen2_flavor, qwen_sliding_windows),
    "Qwen3ForCausalLM": Architecture(qwen3_flavor, qwen_sliding_windows),
    "Gemma2ForCausalLM": Architecture(gemma2_flavor, layer_type_sliding_windows),
    "Gemma3ForCausalLM": Architecture(gemma3_flavor, layer_type_sliding_windows),
    "Phi3ForCausalLM": Architecture(phi3_flavor, mistral_sliding_windows),
    "Olmo2ForCausalLM": Architecture(olmo2_flavor, no_sliding_windows),
    "GraniteForCausalLM": Architecture(granite_flavor, no_sliding_windows),
    "Qwen3MoeForCausalLM": Architecture(qwen3_moe_flavor, mistral_sliding_windows),  # as HF: wherever set
    "MixtralForCausalLM": Architecture(mixtral_flavor, mistral_sliding_windows),
}


_REFUSAL_HINTS = {  # near misses a user is likely to try
    "Gemma3ForConditionalGeneration": " (the multimodal Gemma 3, 4b and up: pagednb runs text-only decoders, "
                                      "such as gemma-3-1b's Gemma3ForCausalLM)",
}


def _architecture_name(hf_config) -> str:
    """The config's architecture, or UnsupportedArchitectureError listing what is supported."""
    names = getattr(hf_config, "architectures", None) or []
    name = names[0] if names else None
    if name not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {name!r} is not supported by pagednb{_REFUSAL_HINTS.get(name, '')}; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    return name


def model_spec(hf_config) -> ModelSpec:
    """The model's ModelSpec (UnsupportedArchitectureError first if pagednb cannot run it; then a
    ValueError naming the field if the config's numbers are not sane, before anything is sized by them)."""
    name = _architecture_name(hf_config)
    check_hf_config(hf_config)
    return ModelSpec.from_hf_config(hf_config, name, SUPPORTED_ARCHITECTURES[name].sliding_windows(hf_config))


def build_model(spec: ModelSpec, hf_config, attn_backend: AttentionBackend) -> CausalLM:
    """The decoder of spec's architecture, in its flavour (weights as torch initialises them, or none on
    the meta device)."""
    flavor = SUPPORTED_ARCHITECTURES[spec.architecture].flavor(hf_config)
    return CausalLM(spec, hf_config, flavor, attn_backend)
