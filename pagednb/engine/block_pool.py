"""The pool of KV-cache blocks: a free list, reference counts and the prefix-cache index.

Blocks are plain objects; the free list threads through them (prev/next pointers), so taking a cached
block back out of the middle of the free list when a prefix hit lands on it is O(1). Freed blocks keep
their hash ("cached free") and are reused least-recently-freed first; a block's hash is dropped only
when it is handed out again (lazy eviction).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

BlockHash = int


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of a full block: its tokens and, through the parent's hash, every token before it."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass(eq=False, slots=True)  # slots: no per-block __dict__ (a pool has up to ~10^6 blocks)
class KVBlock:
    """One block of `block_size` token slots in every layer's cache."""

    block_id: int
    ref_cnt: int = 0
    # Prefix-cache identity, set while the block holds a full, hashed block of tokens.
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    parent: KVBlock | None = None
    parent_epoch: int = -1
    # Bumped whenever the block's content identity is dropped, so children can tell a stale parent.
    epoch: int = 0
    # Free-list links (None while the block is in use).
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in least-recently-freed order; all operations O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        if self.num_free == 0:
            raise RuntimeError("no free KV blocks")
        block = self._head.next_free
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every block: allocation, freeing, and lookup of cached full blocks by chained hash."""

    def __init__(self, num_blocks: int, enable_caching: bool,
                 hash_fn: Callable[[BlockHash | None, Sequence[int]], BlockHash] = hash_block_tokens):
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        # hash -> the block cached under it, or a list of them when several share the hash (collisions, or
        # the same content computed twice before either was cached); content is verified on every hit. A
        # lone block is stored as itself: a container per cached block would be an object that the garbage
        # collector tracks for as long as the block stays cached (a hybrid model caches one per layer group).
        self._cached: dict[BlockHash, KVBlock | list[KVBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never-used ones and cached free ones alike."""
        return self.free_queue.num_free

    @property
    def num_cached_blocks(self) -> int:
        return sum(1 if isinstance(entry, KVBlock) else len(entry) for entry in self._cached.values())

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...], parent: KVBlock | None) -> KVBlock | None:
        """The cached block holding exactly `token_ids` after exactly the prefix ending in `parent`."""
        entry = self._cached.get(block_hash)
        if entry is None:
            return None
        for block in (entry,) if isinstance(entry, KVBlock) else entry:
            if block.token_ids == token_ids and block.parent is parent and (
                    parent is None or block.parent_epoch == parent.epoch):
                return block
        return None

    def allocate(self, n: int) -> list[KVBlock]:
        """Takes n blocks from the head of the free list (evicting their cached content)."""
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.free_queue.num_free} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes a reference on blocks found by a prefix hit (pulling free ones off the free list)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops a reference; blocks reaching zero go to the tail of the free list, content kept.

        Callers pass a request's blocks tail first, so its last blocks are evicted before its first
        ones: a shared prefix outlives the unique suffixes that follow it.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than referenced")

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash, token_ids: tuple[int, ...],
                         parent: KVBlock | None) -> None:
        """Registers a block that has just become full so later requests can reuse it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        block.parent, block.parent_epoch = parent, (parent.epoch if parent is not None else -1)
        entry = self._cached.get(block_hash)
        if entry is None:
            self._cached[block_hash] = block
        elif isinstance(entry, KVBlock):
            self._cached[block_hash] = [entry, block]
        else:
            entry.append(block)

    def forget(self, blocks: Iterable[KVBlock]) -> None:
        """Drops blocks from the prefix-cache index at once, whoever holds them: their K/V cannot be trusted
        (the request that computed them ended with NaN logits). Holders keep using them; no new request can
        hit them, nor, through the bumped epoch, any block cached after them."""
        for block in blocks:
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        entry = self._cached[block.block_hash]
        if entry is block:
            del self._cached[block.block_hash]
        else:
            entry.remove(block)
            if len(entry) == 1:
                self._cached[block.block_hash] = entry[0]
        block.block_hash = block.token_ids = block.parent = None
        block.epoch += 1

    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """Asserts free xor referenced, and ref counts equal the number of block tables holding each block."""
        free_ids = {block.block_id for block in self.free_queue}
        assert len(free_ids) == self.free_queue.num_free, "free list holds a block twice"
        for block in self.blocks:
            refs = expected_refs.get(block.block_id, 0)
            assert block.ref_cnt == refs, f"{block}: ref_cnt {block.ref_cnt} != {refs} holders"
            assert (block.block_id in free_ids) == (refs == 0), f"{block}: free xor referenced broken"
        for block_hash, entry in self._cached.items():
            assert isinstance(entry, KVBlock) or len(entry) > 1, f"hash {block_hash}: a list of {len(entry)}"
            for block in (entry,) if isinstance(entry, KVBlock) else entry:
                assert block.block_hash == block_hash, f"{block} indexed under a stale hash"
