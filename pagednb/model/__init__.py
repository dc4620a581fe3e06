"""Models: the architecture registry, spec, pagednb's decoder, and loading from HF checkpoints."""
from pagednb.model.decoder import CausalLM, DecoderFlavor
from pagednb.model.loader import (ModelNotFoundError, WeightLoadError, load_hf_config, load_model,
                                  load_tokenizer, resolve_model_path)
from pagednb.model.registry import (SUPPORTED_ARCHITECTURES, Architecture, UnsupportedArchitectureError,
                                    build_model, model_spec)
from pagednb.model.spec import ModelSpec

__all__ = [
    "CausalLM", "DecoderFlavor", "ModelNotFoundError", "WeightLoadError", "load_hf_config", "load_model",
    "load_tokenizer", "resolve_model_path", "SUPPORTED_ARCHITECTURES", "Architecture",
    "UnsupportedArchitectureError", "build_model", "model_spec", "ModelSpec",
]
