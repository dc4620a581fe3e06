"""The KV cache manager of a model mixing sliding-window and full-attention layers (kv_cache_groups.py).

One KVCacheManager per layer group, all drawing from one BlockPool; this class keeps them in step and
gives the scheduler the same interface a single manager does:
  * room: a step's blocks are counted over every group before any is taken, so admission and
    preemption see what the request really needs (a sliding group first releases what left its window);
  * prefix hits: every group looks up its own chain of cached blocks (sliding groups keep theirs cached
    when they release them, like any freed block); the hit is capped at the shortest chain, so it is taken
    only where every group has what the first new query reads. A sliding group then holds only the hit
    blocks inside its window. Capping is the simple choice: a sliding block evicted before the window's
    start still cuts the hit there (its chain is how the content is verified), which costs hit length,
    never correctness;
  * block ids: per group, a list of lists ([] when no group got a block: the common decode step);
  * lockstep: every group's block list has the same length (a sliding group keeps None where it released a
    block) and the same number of cached blocks, since every group takes the same calls and a prefix hit
    has one length in every group. So group 0 answers "room in the last block?" and "a block to cache?" for
    all: a decode step costs one check per request, as a uniform model's does, not one per group;
  * a failed request (free_and_forget) drops its own blocks from every group's index, the ones its sliding
    groups released included.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagednb.engine.block_pool import BlockPool
from pagednb.engine.kv_cache_groups import KVCacheLayout
from pagednb.engine.kv_cache_manager import KVCacheManager, PrefixHit
from pagednb.request import Request


@dataclass
class GroupedPrefixHit:
    """A hit of num_tokens tokens in every group; group_hits[g] holds group g's blocks."""

    group_hits: list[PrefixHit]
    num_tokens: int


class HybridKVCacheManager:
    """The scheduler's KV cache manager for a hybrid model: one KVCacheManager per layer group, one pool."""

    def __init__(self, pool: BlockPool, block_size: int, windows: list[int | None]) -> None:
        self.pool = pool
        self.block_size = block_size
        self.caching = pool.enable_caching
        self.groups = [KVCacheManager(pool, block_size, window, i) for i, window in enumerate(windows)]
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0

    def begin_step(self) -> None:
        for group in self.groups:
            group.begin_step()

    def find_prefix_hit(self, req: Request) -> GroupedPrefixHit:
        hits = [group.find_prefix_hit(req) for group in self.groups]
        num_blocks = min(len(hit.blocks) for hit in hits)
        num_tokens = num_blocks * self.block_size
        return GroupedPrefixHit([PrefixHit(hit.blocks[:num_blocks], num_tokens) for hit in hits], num_tokens)

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: GroupedPrefixHit | None = None
                       ) -> list[list[int]] | None:
        """Room for num_new_tokens more tokens in every group, or None if the pool is short. Returns the
        new block ids per group, or [] when no group needs any (nothing to release either)."""
        if hit is None:
            if self.groups[0].has_room(req, num_new_tokens):
                return []  # the common decode step (in lockstep: every group has the room)
            group_hits = [None] * len(self.groups)
        else:
            group_hits = hit.group_hits
        pairs = list(zip(self.groups, group_hits))
        needed = sum(group.blocks_needed(req, num_new_tokens, group_hit) for group, group_hit in pairs)
        if needed > self.pool.num_free_blocks:
            return None
        if hit is not None and self.caching:  # an admission: count it for the hit rate
            self.prefix_cache_query_tokens += req.num_tokens
            self.prefix_cache_hit_tokens += hit.num_tokens
        for group, group_hit in pairs:  # every group's hit first: one group's new block must not be another's hit
            group.claim_hit(group_hit)
        new_ids = [group.take(req, num_new_tokens, group_hit) for group, group_hit in pairs]
        return new_ids if any(new_ids) else []

    def commit_computed(self, req: Request, num_computed: int) -> None:
        if self.groups[0].has_blocks_to_cache(req, num_computed):  # (in lockstep: then every group has)
            for group in self.groups:
                group.commit_computed(req, num_computed)

    def free(self, req: Request) -> None:
        for group in reversed(self.groups):
            group.free(req)

    def free_and_forget(self, req: Request) -> None:
        for group in reversed(self.groups):
            group.free_and_forget(req)

    def block_ids(self, request_id: str) -> list[list[int]]:
        return [group.block_ids(request_id) for group in self.groups]

    def num_blocks_held(self, request_id: str) -> int:
        return sum(group.num_blocks_held(request_id) for group in self.groups)

    def block_map(self) -> list[tuple[str, str | None]]:
        """Every block of the pool, whichever group holds it, with the first owner found."""
        maps = [group.block_map() for group in self.groups]
        return [next((entry for entry in entries if entry[1] is not None), entries[0]) for entries in zip(*maps)]

    def reference_counts(self) -> dict[int, int]:
        """Holders of each block over every group. A block holds one group's layers, so two groups holding the
        same block would write each other's K/V: asserted here (the engine's check_integrity, for tests)."""
        counts: dict[int, int] = {}
        for group in self.groups:
            for block_id, n in group.reference_counts().items():
                assert block_id not in counts, f"block {block_id} is held by two layer groups"
                counts[block_id] = n
        return counts


def make_kv_cache_manager(pool: BlockPool, block_size: int,
                          layout: KVCacheLayout) -> KVCacheManager | HybridKVCacheManager:
    """Today's single manager for a uniform model; the grouped one for a hybrid model."""
    if layout.is_hybrid:
        return HybridKVCacheManager(pool, block_size, layout.windows)
    return KVCacheManager(pool, block_size, layout.groups[0].window)
