"""Which HF architectures pagednb can run, and the class that runs each."""
from __future__ import annotations

from pagednb.model.decoder import (CausalLM, LlamaForCausalLM, MistralForCausalLM,
                                   Qwen2ForCausalLM, Qwen3ForCausalLM)
from pagednb.model.spec import check_architecture

SUPPORTED_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(hf_config) -> type[CausalLM]:
    """The class for the config's architecture; UnsupportedArchitectureError if there is none."""
    return SUPPORTED_ARCHITECTURES[check_architecture(hf_config)]
