"""How the layers of a model share the KV pool: one group per attention type, or one group of every layer.

A model whose layers all attend alike (every layer full, or every layer through the same window) has one
group: a block id names `block_size` token slots in every layer's cache, as it always has.

A model that mixes sliding-window and full-attention layers (Gemma 2/3, Qwen2/3 with mixed layer_types)
gets vLLM's hybrid layout, simplified: the layers are split into groups of P layers, every group holding
layers of one attention type. The cache is P tensors of [2, num_blocks, block_size, Hkv, D]; the j-th
layer of every group uses tensor j. P is the greatest common divisor of the per-type layer counts (no group
padded) or, where that makes many small groups, a larger P whose padding stays small (layers_per_block): the
host's work per step grows with the number of groups (each keeps its block lists and its block table), so
Gemma-3-1B's 22 sliding + 4 full layers get 6 + 1 groups of 4 layers (one group of 2 sliding layers padded
to 4) instead of 11 + 2 groups of 2. So a block id is P layers' worth of memory, and it means different
layers depending on which group holds it: all groups draw from ONE pool of block ids. That is why the
memory stays fungible — a batch of short requests uses the sliding groups' blocks as freely as the full
groups' ones — while a sliding group only holds the blocks of its last window, so a long request costs
full-attention memory for its full layers alone. Each group keeps its own block list per request and its
own block table in the runner; token t sits at block index t // block_size in every group's table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that attend alike and share a block table: full attention (window None) or window W."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    layers_per_block: int  # P: the layers one block id spans (= the number of cache tensors)
    layer_group: tuple[int, ...]  # per layer: the group whose block table it reads
    layer_tensor: tuple[int, ...]  # per layer: which of the P cache tensors it reads and writes

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def windows(self) -> list[int | None]:
        return [group.window for group in self.groups]


def plan_kv_cache_layout(sliding_windows: tuple[int | None, ...]) -> KVCacheLayout:
    """The layout for a model whose layer i attends through sliding_windows[i] (None: full attention)."""
    num_layers = len(sliding_windows)
    if len(set(sliding_windows)) <= 1:  # uniform: today's one tensor per layer, one block table
        return KVCacheLayout((KVCacheGroup(sliding_windows[0] if num_layers else None, tuple(range(num_layers))),),
                             num_layers, (0,) * num_layers, tuple(range(num_layers)))
    by_type: dict[int | None, list[int]] = {}
    for layer, window in enumerate(sliding_windows):
        by_type.setdefault(window, []).append(layer)
    size = layers_per_block([len(layers) for layers in by_type.values()])
    groups: list[KVCacheGroup] = []
    layer_group, layer_tensor = [0] * num_layers, [0] * num_layers
    for window, layers in by_type.items():
        for start in range(0, len(layers), size):
            members = tuple(layers[start:start + size])
            for j, layer in enumerate(members):
                layer_group[layer], layer_tensor[layer] = len(groups), j
            groups.append(KVCacheGroup(window, members))
    return KVCacheLayout(tuple(groups), size, tuple(layer_group), tuple(layer_tensor))


MAX_PADDING = 1 / 8  # of a type's layers: the unused layer slots its padded group may cost


def layers_per_block(counts: list[int]) -> int:
    """P for attention types of counts[t] layers: the largest P up to the biggest count where every type's
    last group pads at most MAX_PADDING of that type's layers (its blocks' unused slots are memory lost);
    at least the greatest common divisor, which pads nothing."""
    best = math.gcd(*counts)
    for size in range(best + 1, max(counts) + 1):
        if all(-n % size <= MAX_PADDING * n for n in counts):
            best = size
    return best


def blocks_for_one_request_of(layout: KVCacheLayout, max_model_len: int, block_size: int,
                              max_num_batched_tokens: int) -> int:
    """Every layer group's blocks count. A hybrid model's sliding groups hold only their window, plus, with
    asynchronous scheduling, the previous chunk until it is committed (KVCacheManager._release_out_of_window):
    two chunks are counted."""
    chunk = 2 * max_num_batched_tokens if layout.is_hybrid else max_num_batched_tokens
    return sum(blocks_for_one_request(max_model_len, block_size, group.window, chunk) for group in layout.groups)


def blocks_for_one_request(max_model_len: int, block_size: int, sliding_window: int | None,
                           max_num_batched_tokens: int) -> int:
    """Blocks one max_model_len request holds at its peak (a sliding window caps what it keeps)."""
    tokens = max_model_len
    if sliding_window is not None:
        tokens = min(max_model_len, sliding_window + max_num_batched_tokens)
    return -(-tokens // block_size) + (1 if sliding_window is not None else 0)
