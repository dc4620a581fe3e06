"""A read-only picture of the prefix cache: its blocks as a forest of shared prefixes.

Each cached block records the block before it in its sequence (`KVBlock.parent`), so the cache is a
tree: a root is the first block of some prompt, a node with several children is a prefix that
several sequences share. A block whose parent's content was evicted (its epoch moved on) can never be
hit again — a lookup needs the whole chain — so it is shown apart as unreachable, waiting its turn to
be evicted. Built from plain reads of the BlockPool; it changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixNode:
    """One cached block."""

    block_id: int
    parent_id: int | None  # None: the first block of a sequence (or unreachable)
    token_ids: tuple[int, ...]
    ref_cnt: int  # requests holding it now (0: free, kept for reuse)
    eviction_rank: int | None  # 1 = the next block the pool hands out (its content lost); None while in use
    depth: int  # 0 for a root; a reachable block covers tokens [depth * block_size, (depth + 1) * block_size)
    reachable: bool  # False: a block before it was evicted, no request can hit it any more


@dataclass(frozen=True)
class PrefixCacheSnapshot:
    block_size: int
    num_blocks: int  # the whole pool
    num_free: int  # blocks the pool can hand out now (cached free ones included)
    nodes: tuple[PrefixNode, ...]  # parents before children

    def roots(self) -> list[PrefixNode]:
        return [node for node in self.nodes if node.parent_id is None]

    def children(self, block_id: int) -> list[PrefixNode]:
        return [node for node in self.nodes if node.parent_id == block_id]

    def eviction_order(self) -> list[int]:
        """Cached free blocks' ids, next to be evicted first."""
        free = [node for node in self.nodes if node.eviction_rank is not None]
        return [node.block_id for node in sorted(free, key=lambda node: node.eviction_rank)]


def snapshot_prefix_cache(pool, block_size: int) -> PrefixCacheSnapshot:
    """The pool's cached blocks as a PrefixCacheSnapshot (O(blocks): for views, not for the step)."""
    ranks = {block.block_id: rank for rank, block in enumerate(pool.free_queue, start=1)}
    cached = {block.block_id: block for block in pool.blocks if block.block_hash is not None}
    depths: dict[int, tuple[int, bool]] = {}

    def place(block) -> tuple[int, bool]:
        """(depth, reachable) of a cached block, walking up to its root (iteratively: chains are long)."""
        chain = []
        while block.block_id not in depths:
            parent = _live_parent(block, cached)
            if parent is None:
                depths[block.block_id] = (0, block.parent is None)
                break
            chain.append(block)
            block = parent
        for child in reversed(chain):
            depth, reachable = depths[_live_parent(child, cached).block_id]
            depths[child.block_id] = (depth + 1, reachable)
        return depths[chain[0].block_id] if chain else depths[block.block_id]

    nodes = []
    for block in cached.values():
        depth, reachable = place(block)
        parent = _live_parent(block, cached)
        nodes.append(PrefixNode(block.block_id, parent.block_id if parent is not None else None,
                                tuple(block.token_ids), block.ref_cnt, ranks.get(block.block_id), depth,
                                reachable))
    nodes.sort(key=lambda node: (node.depth, node.block_id))
    return PrefixCacheSnapshot(block_size, pool.num_blocks, pool.num_free_blocks, tuple(nodes))


def _live_parent(block, cached: dict):
    """The block's parent while the parent still holds the content this block was cached after."""
    parent = block.parent
    if parent is None or parent.block_id not in cached or parent.epoch != block.parent_epoch:
        return None
    return parent
