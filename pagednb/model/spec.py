"""ModelSpec: the few numbers about a model that the engine (cache sizing, attention) needs, checked
for sanity before anything is sized by them, and the memory estimate that refuses a start-up which
cannot fit before any allocation.

It is read once from the HF config (registry.model_spec builds it) so the rest of pagednb never has to
know how each architecture spells its fields (head_dim, num_key_value_heads, sliding-window flags, ...).
A config with 0 heads, heads that do not divide, or dimensions implying terabytes of weights raises a
ValueError naming the field (and the estimated bytes) here, not an allocator crash minutes later.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagednb.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from pagednb.engine.kv_cache_groups import blocks_for_one_request_of, plan_kv_cache_layout
from pagednb.validation import as_int

# More parameters than any checkpoint pagednb could load (4.4e12: 8.8 TB in bfloat16); a config above this
# is a typo or a corrupted file, and building it would try to allocate that much.
MAX_PARAMETERS = 2**42
GiB = 2**30


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...]  # one per layer; None = full attention
    num_parameters: int = 0  # estimated from the config (embeddings, attention, MLP); sizes the memory check

    def __post_init__(self) -> None:
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"model config gives {len(self.sliding_windows)} layer types (sliding windows) for "
                             f"num_hidden_layers={self.num_layers}; they must match")
        for i, window in enumerate(self.sliding_windows):
            if window is not None:
                as_int(f"model config sliding_window (layer {i})", window, "None or an int >= 1", 1)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers in the KV cache's dtype (sizes the block
        pool; an fp8 cache: 1 byte per element)."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @property
    def sliding_window(self) -> int | None:
        """The window when every layer slides by the same window (cache can be bounded), else None."""
        windows = set(self.sliding_windows)
        return windows.pop() if len(windows) == 1 else None

    @classmethod
    def from_hf_config(cls, cfg, architecture: str, sliding_windows: tuple[int | None, ...]) -> ModelSpec:
        """The fields every supported architecture spells alike; what differs per architecture (the
        layers' sliding windows) comes from its registry entry. check_hf_config has passed."""
        num_heads = cfg.num_attention_heads
        return cls(
            architecture=architecture,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            sliding_windows=sliding_windows,
            num_parameters=estimate_num_parameters(cfg),
        )


# ---- the config's numbers, before anything is sized by them ---------------------------------------------
CONFIG_DIMENSIONS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings")


def check_hf_config(cfg) -> None:
    """Every dimension a positive int, heads that divide, and at most MAX_PARAMETERS parameters. Reads only
    the config (nothing is allocated), and runs before the per-layer tables are built, so a config with
    10**9 layers is refused at once. Integral floats are converted in place (JSON may store 64.0)."""
    for name in CONFIG_DIMENSIONS:
        setattr(cfg, name, as_int(f"model config {name}", getattr(cfg, name, None), "an int >= 1", 1))
    heads = cfg.num_attention_heads
    for name in ("num_key_value_heads", "head_dim"):
        if getattr(cfg, name, None) is not None:
            setattr(cfg, name, as_int(f"model config {name}", getattr(cfg, name), "None or an int >= 1", 1))
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ValueError(f"model config num_key_value_heads ({kv_heads}) must divide num_attention_heads "
                         f"({heads}): each KV head serves a whole group of query heads")
    if getattr(cfg, "head_dim", None) is None and cfg.hidden_size % heads:
        raise ValueError(f"model config hidden_size ({cfg.hidden_size}) must be divisible by num_attention_heads "
                         f"({heads}) when head_dim is not given (head_dim = hidden_size / heads)")
    head_dim = _head_dim(cfg)
    if head_dim % 2:
        raise ValueError(f"model config head_dim must be even (rotary embeddings rotate pairs), got {head_dim}")
    params = estimate_num_parameters(cfg)
    if params > MAX_PARAMETERS:
        raise ValueError(
            f"model config implies {params:.3g} parameters ({_bytes(2 * params)} in bfloat16), over the "
            f"{MAX_PARAMETERS:.3g} pagednb accepts (hidden_size={cfg.hidden_size}, num_hidden_layers="
            f"{cfg.num_hidden_layers}, vocab_size={cfg.vocab_size}, intermediate_size={cfg.intermediate_size}, "
            f"num_attention_heads={heads}); the config is probably wrong")


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def estimate_num_parameters(cfg) -> int:
    """Embeddings (and an untied LM head), attention projections and the gated MLP: within a few per cent
    of the real count (norms and biases are left out). Python ints, so absurd configs cannot overflow."""
    hidden, heads, head_dim = cfg.hidden_size, cfg.num_attention_heads, _head_dim(cfg)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    embeddings = cfg.vocab_size * hidden * (1 if tied else 2)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * cfg.intermediate_size
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    expert_size = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    if isinstance(experts, int) and isinstance(expert_size, int) and experts > 0:
        mlp = 3 * hidden * expert_size * experts  # MoE (Qwen3-MoE, Mixtral): all the layer's experts
    return embeddings + cfg.num_hidden_layers * (attention + mlp)


# ---- memory, before the weights are loaded -----------------------------------------------------------------
def estimate_bytes(spec: ModelSpec, dtype: torch.dtype, *, block_size: int, max_model_len: int, max_num_seqs: int,
                   max_num_batched_tokens: int, num_kv_blocks: int | None, kv_block_bytes: int) -> dict[str, int]:
    """The large allocations of a start-up and of one full step, by part: an underestimate on purpose
    (activations beyond the logits and allocator slack are left out), so a refusal is never a false
    alarm. num_kv_blocks None: the KV pool is sized later from what is left."""
    element = torch.empty((), dtype=dtype).element_size()
    blocks_per_seq = -(-max_model_len // block_size)
    parts = {
        "weights": spec.num_parameters * element,
        "rotary table": spec.max_position_embeddings * spec.head_dim * 2 * 4,
        "block tables": 3 * max_num_seqs * blocks_per_seq * 4,  # numpy table, pinned staging, device copy
        "logits": max_num_seqs * spec.vocab_size * (element + 4),  # one row per sequence, and its float32 copy
        "step buffers": 2 * max(max_num_batched_tokens, max_num_seqs) * (3 * 8 + spec.hidden_size * element),
    }
    if num_kv_blocks is not None:
        parts["KV cache"] = num_kv_blocks * kv_block_bytes
    return parts


def check_start_up_memory(spec: ModelSpec, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                          max_model_len: int, max_num_batched_tokens: int) -> None:
    """Refuses, before the weights are loaded, a start-up whose estimated memory exceeds what the device
    has (GPU: free now; CPU: physical RAM), stating the estimate by part, instead of an allocator crash
    or minutes of swapping. On a CPU without num_kv_blocks the KV pool is its byte budget (capped at what
    max_num_seqs full-length requests use); on a GPU it is sized later from what is left."""
    num_kv_blocks = config.num_kv_blocks
    # a block id spans every layer, or in a hybrid model one layer group's (engine/kv_cache_groups.py)
    layout = plan_kv_cache_layout(spec.sliding_windows)
    block_bytes = (spec.kv_bytes_per_token(config.resolve_kv_cache_dtype(dtype)) // spec.num_layers
                   * layout.layers_per_block * config.block_size)
    if num_kv_blocks is None and device.type != "cuda":
        useful = config.max_num_seqs * blocks_for_one_request_of(layout, max_model_len, config.block_size,
                                                                 max_num_batched_tokens)
        num_kv_blocks = min((config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY) // block_bytes, useful)
    parts = estimate_bytes(spec, dtype, block_size=config.block_size, max_model_len=max_model_len,
                           max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           num_kv_blocks=num_kv_blocks, kv_block_bytes=block_bytes)
    total = sum(parts.values())
    available, what = device_memory(device)
    if total <= available:
        return
    detail = ", ".join(f"{name} {_bytes(n)}" for name, n in sorted(parts.items(), key=lambda kv: -kv[1]) if n)
    raise ValueError(
        f"{spec.architecture} in {dtype} with these options needs an estimated {_bytes(total)} ({detail}), more "
        f"than the {_bytes(available)} of {what}. Lower max_num_seqs, max_model_len, max_num_batched_tokens, "
        f"num_kv_blocks or kv_cache_memory, use a smaller dtype or model, or close() other engines first.")


def device_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, description) of the memory a start-up on `device` may use: free GPU memory, or host RAM."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, f"free memory on {device} ({_bytes(total)} in all)"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory (RAM)"


def _bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} bytes"
