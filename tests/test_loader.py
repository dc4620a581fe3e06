"""Finding models and loading checkpoints: clear errors for every way it can go wrong."""
from __future__ import annotations

import json
import shutil

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import make_tiny_model
from transformers import AutoModelForCausalLM

from pagednb.attention import TorchReferenceBackend
from pagednb.model import (SUPPORTED_ARCHITECTURES, ModelNotFoundError, UnsupportedArchitectureError,
                           WeightLoadError, load_hf_config, load_model, load_tokenizer, model_spec,
                           resolve_model_path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def model_copy(tiny_llama, tmp_path):
    """A private copy of the tiny checkpoint that a test may damage."""
    return shutil.copytree(tiny_llama, tmp_path / "model")


def load(path, dtype=torch.float32):
    cfg = load_hf_config(path)
    return load_model(path, cfg, model_spec(cfg), dtype, torch.device("cpu"), TorchReferenceBackend())


def test_local_folder_resolves_to_itself(tiny_llama):
    assert resolve_model_path(str(tiny_llama)) == tiny_llama
    assert load_tokenizer(tiny_llama).eos_token == "</s>"


@pytest.mark.parametrize("name", ["/no/such/model", "./missing-model", "~/missing-model", "a/b/c"])
def test_missing_local_path_is_reported_by_name(name):
    with pytest.raises(ModelNotFoundError, match=f"{name}.*does not exist"):
        resolve_model_path(name)


def test_offline_unknown_hub_id_says_what_to_download(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="huggingface-cli download nobody-here/made-up-model"):
        resolve_model_path("nobody-here/made-up-model")


def test_unsupported_architecture_lists_the_supported_ones(model_copy):
    config_file = model_copy / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "architectures": ["FancyNewForCausalLM"]}))
    with pytest.raises(UnsupportedArchitectureError, match="FancyNewForCausalLM") as error:
        load(model_copy)
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


def test_spec_and_registry_agree_on_what_is_supported(tiny_llama):
    cfg = load_hf_config(tiny_llama)
    for arch in SUPPORTED_ARCHITECTURES:
        cfg.architectures = [arch]
        assert model_spec(cfg).architecture == arch


def test_sharded_checkpoint_loads_identically(tiny_llama, tmp_path):
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(sharded, max_shard_size="50KB")
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    shutil.copy(tiny_llama / "config.json", sharded / "config.json")
    whole, split = load(tiny_llama).state_dict(), load(sharded).state_dict()
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[k], split[k]) for k in whole)


def test_weights_are_cast_to_the_requested_dtype(tiny_llama):
    model = load(tiny_llama, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training


def test_pickle_only_checkpoint_is_refused(model_copy):
    tensors = load_file(model_copy / "model.safetensors")
    (model_copy / "model.safetensors").unlink()
    torch.save(tensors, model_copy / "pytorch_model.bin")
    with pytest.raises(WeightLoadError, match="pytorch_model.bin.*only.*safetensors"):
        load(model_copy)


def test_missing_weight_is_named(model_copy):
    tensors = load_file(model_copy / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load(model_copy)
