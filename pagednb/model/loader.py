"""Finding a model (local folder or HF Hub id) and loading its config, tokenizer and weights.

Weights are read only from safetensors: pickle-based .bin checkpoints can run arbitrary code when
loaded, and an inference server should not execute files it downloads.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from pagednb.attention.backend import AttentionBackend
from pagednb.model.decoder import CausalLM
from pagednb.model.kv_scales import is_kv_scale, load_kv_scale
from pagednb.model.layers import MergedLinear
from pagednb.model.moe import FusedExperts, checkpoint_tensors
from pagednb.model.registry import build_model
from pagednb.model.spec import CONFIG_DIMENSIONS, ModelSpec, check_hf_config

if TYPE_CHECKING:  # distributed/ builds on the model package: imported where used, to keep imports one-way
    from pagednb.distributed.parallel_layers import ShardRule
    from pagednb.distributed.process_group import TensorParallelGroup

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "tokenizer*"]
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class ModelNotFoundError(ValueError):
    """Neither a local folder nor a Hub repository that can be reached or found in the cache."""


class WeightLoadError(ValueError):
    """The checkpoint's tensors do not fit the model (missing, unexpected, misshapen, not safetensors)."""


def _looks_local(model: str) -> bool:
    """Hub ids are `name` or `org/name`; anything path-shaped is meant as a local folder."""
    if model.startswith(("/", "./", "../", "~", ".\\")) or model.count("/") > 1:
        return True
    parent = Path(model).parent
    return parent != Path(".") and parent.exists()


def resolve_model_path(model: str | os.PathLike, revision: str | None = None) -> Path:
    """A local model folder, or the Hub snapshot folder of `model` (downloaded if needed)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if isinstance(model, os.PathLike) or _looks_local(str(model)) or path.exists():
        raise ModelNotFoundError(f"model folder {str(model)!r} does not exist (or is not a folder)")
    return _snapshot(str(model), revision)


def _snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (HFValidationError, LocalEntryNotFoundError,
                                       RepositoryNotFoundError, RevisionNotFoundError)
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError as e:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache and the Hub cannot be reached "
            f"(offline or no network). On a connected machine run `huggingface-cli download "
            f"{repo_id}` (or `hf download {repo_id}`) and copy the cache, or pass a local model "
            f"folder instead.") from e
    except (RepositoryNotFoundError, RevisionNotFoundError, HFValidationError) as e:
        raise ModelNotFoundError(
            f"model {repo_id!r} (revision {revision or 'main'}) was not found on the Hugging Face Hub "
            f"and is not a local folder: {e}") from e


def load_hf_config(path: Path, trust_remote_code: bool = False):
    """The HF config; its numbers are checked first from config.json itself (spec.check_hf_config), since
    transformers divides by num_attention_heads and builds per-layer lists while constructing it."""
    from transformers import AutoConfig
    _check_raw_config(Path(path))
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError:
        raise
    except Exception as e:  # transformers' own validation: strict field types, divisibility
        raise ValueError(f"{Path(path) / 'config.json'} is not a valid model config: {e}") from e


def _check_raw_config(path: Path) -> None:
    """check_hf_config on config.json's top-level numbers, when it has the usual decoder fields (a config
    that nests them, e.g. a multimodal one, is left to the architecture check)."""
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError):
        return  # missing or unreadable: AutoConfig says so in its own words
    if isinstance(raw, dict) and all(name in raw for name in CONFIG_DIMENSIONS):
        check_hf_config(SimpleNamespace(**raw))


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_model(path: Path, hf_config, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
               attn_backend: AttentionBackend, load_format: str = "auto",
               tp: TensorParallelGroup | None = None) -> CausalLM:
    """Build the model of spec (registry.model_spec) without initialising weights, then fill every
    parameter from safetensors ("auto") or with random values on the device ("dummy"). With tp (a
    distributed.TensorParallelGroup) the model is this rank's shard, loaded with its slice of each tensor."""
    with torch.device("meta"):
        model = build_model(spec, hf_config, attn_backend)
        if tp is not None:
            from pagednb.distributed.parallel_layers import shard_model
            shard_model(model, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.reset_buffers()
    if load_format == "dummy" and tp is None:
        init_dummy_weights(model)
    elif load_format == "dummy":  # the tp=1 model's random weights, each rank its slice
        from pagednb.distributed.parallel_layers import dummy_checkpoint
        with torch.device("meta"):
            full = build_model(spec, hf_config, attn_backend)
        _load_tensors(model, dummy_checkpoint(full, weight_targets(full), device, dtype))
    else:
        load_weights(model, safetensors_files(Path(path)))
    return model.eval()


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """vLLM's load_format="dummy": a model of a real shape without its checkpoint (a 61 GB MoE benchmarked
    on a 64 GiB disk), the values drawn where the parameters live. Norm weights 1 and biases 0, matrices
    N(0, 0.02^2) as HF initialises them, so activations stay finite through every layer."""
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=gen)
        else:
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors shards (from the index if sharded); refuses pickle checkpoints."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / name for name in _index_shards(index)]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickled = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
    if pickled:
        raise WeightLoadError(
            f"{path} holds only pickle weights ({', '.join(sorted(pickled))}); pagednb loads only "
            f"*.safetensors, for security (pickle files can run code). Convert the checkpoint to "
            f"safetensors (e.g. save_pretrained(..., safe_serialization=True)).")
    raise WeightLoadError(f"no *.safetensors weights found in {path}")


def _index_shards(index: Path) -> list[str]:
    """The shard files an index names, each a relative .safetensors path inside the model folder: an
    index from the Hub must not make pagednb read files elsewhere ("../x", "/etc/...")."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise WeightLoadError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {e}") from e
    if not isinstance(weight_map, dict):
        raise WeightLoadError(f"{index}: 'weight_map' must map tensor names to shard files")
    if not all(isinstance(name, str) for name in weight_map.values()):
        raise WeightLoadError(f"{index}: every 'weight_map' entry must name a shard file (a str)")
    names = sorted(set(weight_map.values()))
    for name in names:
        if not _is_inside_folder(name) or not name.endswith(".safetensors"):
            raise WeightLoadError(f"{index} names shard {name!r}; shards must be .safetensors files inside "
                                  f"the model folder (a relative path without '..')")
    return names


def _is_inside_folder(name: str) -> bool:
    """Lexically, without following links: the Hub cache links every file to a blob outside the folder."""
    for pure in (PurePosixPath(name), PureWindowsPath(name)):
        if pure.is_absolute() or pure.anchor or ".." in pure.parts:
            return False
    return bool(name.strip())


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield from checkpoint_tensors(name, f.get_tensor(name))  # MoE experts under one naming


def weight_targets(model: CausalLM) -> dict[str, tuple[torch.Tensor, slice | tuple | None, ShardRule | None]]:
    """Checkpoint (HF) tensor name -> (parameter, the part of it: rows, or an expert's rows, and the
    tensor-parallel rule cutting this rank's slice from the checkpoint tensor, None for all of it),
    unpacking the fused projections and the stacked experts."""
    targets: dict[str, tuple[torch.Tensor, slice | tuple | None, ShardRule | None]] = {}
    for module_name, module in model.named_modules():
        rules = getattr(module, "tp_rules", {})  # set by distributed.parallel_layers.shard_model
        if isinstance(module, FusedExperts):
            for name, (param, part) in module.weight_targets(module_name).items():
                targets[name] = (param, part, rules.get(".".join(name.split(".")[-2:])))
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(module, MergedLinear) and not module.fused_in_checkpoint:
                parent = module_name.rpartition(".")[0]
                for shard, rows in module.shard_slices().items():
                    targets[f"{parent}.{shard}.{param_name}"] = (param, rows, rules.get(f"{shard}.{param_name}"))
            else:
                targets[f"{module_name}.{param_name}"] = (param, None, rules.get(param_name))
    return targets


def load_weights(model: CausalLM, files: list[Path]) -> None:
    """Copy every checkpoint tensor into its (part of a) parameter; all must be present. A progress bar
    appears only if loading takes over a second (big checkpoints), so small models stay quiet."""
    _load_tensors(model, _iter_tensors(files))


@torch.no_grad()
def _load_tensors(model: CausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    from tqdm.auto import tqdm
    targets = weight_targets(model)
    loaded, unexpected = set(), []
    bar = tqdm(total=len(targets), desc="Loading weights", unit="tensor", delay=1.0, leave=False)
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.tie_word_embeddings):
            continue
        if is_kv_scale(name):  # an FP8 checkpoint's KV cache scales: floats on the layer, not parameters
            load_kv_scale(model, name, tensor)
            continue
        if name not in targets:
            unexpected.append(name)
            continue
        param, rows, rule = targets[name]
        if rule is not None:
            tensor = rule.take(tensor)
        dest = param if rows is None else param[rows]
        if dest.shape != tensor.shape:
            raise WeightLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                  f"model expects {tuple(dest.shape)}")
        dest.copy_(tensor)
        loaded.add(name)
        bar.update()
    bar.close()
    _check_complete(targets.keys() - loaded, unexpected)


def _check_complete(missing: set[str], unexpected: list[str]) -> None:
    if missing:
        raise WeightLoadError(f"checkpoint is missing weights: {', '.join(sorted(missing))}")
    if unexpected:
        raise WeightLoadError(f"checkpoint has weights the model does not use: "
                              f"{', '.join(sorted(unexpected))}")
