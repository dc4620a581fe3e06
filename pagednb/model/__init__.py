"""Models: spec, pagednb's decoder implementations, and loading from HF checkpoints."""
from pagednb.model.decoder import (CausalLM, LlamaForCausalLM, MistralForCausalLM,
                                   Qwen2ForCausalLM, Qwen3ForCausalLM)
from pagednb.model.loader import (ModelNotFoundError, WeightLoadError, load_hf_config, load_model,
                                  load_tokenizer, resolve_model_path)
from pagednb.model.registry import SUPPORTED_ARCHITECTURES, model_class
from pagednb.model.spec import ModelSpec, UnsupportedArchitectureError

__all__ = [
    "CausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "ModelNotFoundError", "WeightLoadError", "load_hf_config", "load_model", "load_tokenizer",
    "resolve_model_path", "SUPPORTED_ARCHITECTURES", "model_class", "ModelSpec",
    "UnsupportedArchitectureError",
]
