"""The architecture registry: the one place that says what pagednb runs, and what says so elsewhere."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_architectures import ARCHITECTURES
from test_model_equivalence import VARIANTS
from test_moe import MODELS as MOE_MODELS
from tiny import tiny_config

from pagednb.attention import TorchReferenceBackend
from pagednb.model import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError, build_model, model_spec

README = Path(__file__).resolve().parent.parent / "README.md"


def hf_architecture(tiny_arch: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[tiny_config(tiny_arch).model_type]


def config_of(architecture: str, tiny_arch: str, **overrides):
    cfg = tiny_config(tiny_arch, **overrides)
    cfg.architectures = [architecture]
    return cfg


def test_readme_lists_exactly_the_registry_architectures():
    match = re.search(r"Supported architectures:([^.]*)\.", README.read_text())
    assert match, "README.md has no 'Supported architectures:' sentence"
    listed = re.findall(r"`(\w+)`", match.group(1))
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == set(SUPPORTED_ARCHITECTURES)


def test_every_registry_architecture_is_checked_against_hf():
    """tests/test_model_equivalence.py, tests/test_architectures.py and tests/test_moe.py compare a tiny model of
    each supported architecture with HF."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    checked = {hf_architecture(arch) for arch, _ in VARIANTS.values()}
    checked |= {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] for model_type, _ in ARCHITECTURES.values()}
    checked |= {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] for model_type, _ in MOE_MODELS.values()}
    assert checked == set(SUPPORTED_ARCHITECTURES)


def test_multimodal_gemma3_is_refused_naming_the_text_only_checkpoints():
    cfg = tiny_config("llama")
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    with pytest.raises(UnsupportedArchitectureError, match="text-only.*Gemma3ForCausalLM"):
        model_spec(cfg)


def test_unknown_or_missing_architecture_lists_the_supported_ones():
    for architectures in (["FancyNewForCausalLM"], None):
        cfg = tiny_config("llama")
        cfg.architectures = architectures
        with pytest.raises(UnsupportedArchitectureError) as error:
            model_spec(cfg)
        assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("tiny_arch, overrides, windows", [
    ("llama", {}, (None, None)),
    ("mistral", {}, (24, 24)),
    ("mistral", {"sliding_window": None}, (None, None)),
    ("qwen2", {"sliding_window": 10}, (None, None)),  # use_sliding_window is off
    ("qwen3", {"use_sliding_window": True, "sliding_window": 10, "max_window_layers": 1}, (None, 10)),
    ("gemma2", {"num_hidden_layers": 3, "sliding_window": 6}, (6, None, 6)),  # even layers slide
    ("gemma3_text", {"num_hidden_layers": 7, "sliding_window": 6}, (6, 6, 6, 6, 6, None, 6)),  # 5 in 6
    ("phi3", {"sliding_window": 6}, (6, 6)),
])
def test_sliding_window_rules(tiny_arch, overrides, windows):
    spec = model_spec(config_of(hf_architecture(tiny_arch), tiny_arch, **overrides))
    assert spec.sliding_windows == windows


def test_each_architecture_builds_its_flavour():
    def parameters(tiny_arch: str) -> set[str]:
        cfg = config_of(hf_architecture(tiny_arch), tiny_arch)
        with torch.device("meta"):
            model = build_model(model_spec(cfg), cfg, TorchReferenceBackend())
        return {name for name, _ in model.named_parameters()}

    llama, qwen2, qwen3 = parameters("llama"), parameters("qwen2"), parameters("qwen3")
    assert "model.layers.0.self_attn.qkv_proj.bias" not in llama
    assert "model.layers.0.self_attn.qkv_proj.bias" in qwen2
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2
    assert "model.layers.0.self_attn.q_norm.weight" in qwen3
    assert "model.layers.0.self_attn.q_norm.weight" not in llama | qwen2
