"""Maps requests to KV blocks: prefix-cache hits, allocation for each step, freeing, sliding windows.

Policy (who runs, who is preempted) lives in the scheduler; this file only answers "can this request
get room for n more tokens?" and keeps every request's block list.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagednb.engine.block_pool import BlockHash, BlockPool, KVBlock
from pagednb.request import Request


@dataclass
class _RequestBlocks:
    blocks: list[KVBlock | None] = field(default_factory=list)  # None: released (left the window)
    hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of full blocks, in order
    num_cached: int = 0  # leading full blocks already registered in the prefix cache
    num_hit: int = 0  # leading blocks from the prefix hit at admission: computed by others
    num_released: int = 0  # leading blocks released by the sliding window (all None)
    # with prefix caching: the released blocks this request computed and their epochs when released (a
    # changed epoch: evicted since, someone else's now), for free_and_forget; two lists, not a list of pairs,
    # so a release leaves no new object for the garbage collector to track
    released: list[KVBlock] = field(default_factory=list)
    released_epochs: list[int] = field(default_factory=list)


@dataclass
class PrefixHit:
    blocks: list[KVBlock]
    num_tokens: int


class KVCacheManager:
    """Hands blocks to requests. Token t of a request lives in its block t // block_size.

    One manager serves one KV cache group (engine/kv_cache_groups.py): the whole model, or, in a hybrid
    model, one group of layers sharing the pool with the other groups' managers. group_index > 0 gives the
    group its own hash chains (a root seed and a root parent), so no group ever hits another group's
    blocks: the same tokens hold different layers' K/V there.
    """

    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int | None = None,
                 group_index: int = 0) -> None:
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        self._root_hash: BlockHash | None = None if group_index == 0 else group_index
        self._root: KVBlock | None = None if group_index == 0 else KVBlock(-1 - group_index)
        self._reqs: dict[str, _RequestBlocks] = {}
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.caching = pool.enable_caching
        # Full blocks that requests scheduled earlier in this step will compute: a request admitted
        # later in the same step may share them, because a step writes every new K/V of a layer before
        # any of its queries attend. They join the real cache only after the step ran (commit_computed);
        # a free while scheduling (a preemption) withdraws them all, since its blocks may be reused.
        self._this_step: dict[BlockHash, list[tuple[KVBlock, tuple[int, ...], KVBlock | None]]] = {}

    def begin_step(self) -> None:
        self._this_step.clear()

    def find_prefix_hit(self, req: Request) -> PrefixHit:
        """Longest run of cached full blocks matching the request's tokens, content-verified.

        Capped at num_tokens - 1 so the last token is always computed: its logits give the next token.
        A request asking for prompt logprobs takes no hit (as in vLLM): every prompt row must be computed.
        """
        if not self.caching or req.sampling_params.prompt_logprobs is not None:
            return PrefixHit([], 0)
        state = self._reqs.setdefault(req.request_id, _RequestBlocks())
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, state, max_blocks)
        hit: list[KVBlock] = []
        parent = self._root
        for i in range(max_blocks):
            tokens = self._block_tokens(req, i)
            block = self.pool.lookup(state.hashes[i], tokens, parent) or self._lookup_this_step(
                state.hashes[i], tokens, parent)
            if block is None:
                break
            hit.append(block)
            parent = block
        return PrefixHit(hit, len(hit) * self.block_size)

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> list[int] | None:
        """Room for num_new_tokens more tokens (after any prefix hit), or None if the pool is short.

        Returns the ids of the blocks appended to the request's block list (hit blocks first).
        """
        state = self._reqs.get(req.request_id)
        if hit is None and state is not None and self.sliding_window is None:
            if req.num_computed_tokens + num_new_tokens <= len(state.blocks) * self.block_size:
                return []  # the common decode step: room in the last block
        if self.blocks_needed(req, num_new_tokens, hit) > self.pool.num_free_blocks:
            return None
        if hit is not None and self.caching:  # an admission: count it for the hit rate
            self.prefix_cache_query_tokens += req.num_tokens
            self.prefix_cache_hit_tokens += hit.num_tokens
        self.claim_hit(hit)
        return self.take(req, num_new_tokens, hit)

    def has_room(self, req: Request, num_new_tokens: int) -> bool:
        """The common decode step: the last block has room. A block that left a sliding window is released
        at the request's next allocation (blocks_needed releases before it counts), not the step it left: a
        decode step then touches a hybrid model's groups once per block of tokens instead of twice, for at
        most one block per request held a little longer (never read: attention stops at the window)."""
        state = self._reqs.get(req.request_id)
        return state is not None and req.num_computed_tokens + num_new_tokens <= len(state.blocks) * self.block_size

    def blocks_needed(self, req: Request, num_new_tokens: int, hit: PrefixHit | None) -> int:
        """Free blocks that take() will use: new ones plus hit blocks now on the free list. Releases the
        blocks that left the window first, so they count as free."""
        state = self._reqs.get(req.request_id)
        if state is None:
            state = self._reqs[req.request_id] = _RequestBlocks()
        num_computed = req.num_computed_tokens + (hit.num_tokens if hit else 0)
        self._release_out_of_window(state, num_computed)
        hit_blocks = self._visible(hit)
        num_new_blocks = -(-(num_computed + num_new_tokens) // self.block_size) - len(state.blocks) - len(hit_blocks)
        return max(num_new_blocks, 0) + sum(1 for block in hit_blocks if block is not None and block.ref_cnt == 0)

    def claim_hit(self, hit: PrefixHit | None) -> None:
        """Takes a reference on the hit's visible blocks, pulling cached free ones off the free list, before
        take() allocates: a block on the free list is both a possible hit and the next one allocate() hands out
        (a hybrid model's groups share one pool, so every group claims its hit before any group allocates)."""
        self.pool.touch(block for block in self._visible(hit) if block is not None)

    def take(self, req: Request, num_new_tokens: int, hit: PrefixHit | None) -> list[int]:
        """Appends the hit blocks (claimed) and new ones to the request's list (blocks_needed() said they are
        free); returns their ids (0 for a hit block outside the window: never read)."""
        state = self._reqs[req.request_id]
        hit_blocks = self._visible(hit)
        total_tokens = req.num_computed_tokens + (hit.num_tokens if hit else 0) + num_new_tokens
        num_new_blocks = -(-total_tokens // self.block_size) - len(state.blocks) - len(hit_blocks)
        new_blocks = hit_blocks + self.pool.allocate(max(num_new_blocks, 0))
        state.blocks.extend(new_blocks)
        if hit_blocks:
            state.num_cached = state.num_hit = len(hit_blocks)
            state.num_released = sum(block is None for block in hit_blocks)  # the leading ones
        if self.caching:
            self._share_this_step(req, state, min(total_tokens, req.num_tokens) // self.block_size)
        return [block.block_id if block is not None else 0 for block in new_blocks]

    def _visible(self, hit: PrefixHit | None) -> list[KVBlock | None]:
        """The hit's blocks, None for those before the window of the first new query (a sliding group
        checks them in the chain but does not hold them)."""
        if hit is None:
            return []
        if self.sliding_window is None:
            return hit.blocks
        num_hidden = min(max(hit.num_tokens - self.sliding_window + 1, 0) // self.block_size, len(hit.blocks))
        return [None] * num_hidden + hit.blocks[num_hidden:]

    def _share_this_step(self, req: Request, state: _RequestBlocks, num_full: int) -> None:
        """Offers the full blocks this step computes for req to requests scheduled after it."""
        first = state.num_cached
        if num_full <= first:
            return
        self._extend_hashes(req, state, num_full)
        for i in range(first, num_full):
            parent = state.blocks[i - 1] if i > 0 else self._root
            self._this_step.setdefault(state.hashes[i], []).append(
                (state.blocks[i], self._block_tokens(req, i), parent))

    def _lookup_this_step(self, block_hash: BlockHash, tokens: tuple[int, ...], parent: KVBlock | None
                          ) -> KVBlock | None:
        for block, block_tokens, block_parent in self._this_step.get(block_hash, ()):
            if block_tokens == tokens and block_parent is parent:
                return block
        return None

    def commit_computed(self, req: Request, num_computed: int) -> None:
        """Registers the request's blocks now full of computed K/V (its first num_computed tokens) in
        the prefix cache.

        Called after the model ran, never at scheduling time: a step that is interrupted (an
        exception, a KeyboardInterrupt) must not leave blocks in the cache whose K/V was never
        written. (With asynchronous scheduling req.num_computed_tokens already counts the next step.)
        """
        if self.has_blocks_to_cache(req, num_computed):
            self._cache_full_blocks(req, state=self._reqs[req.request_id], num_tokens=num_computed)

    def has_blocks_to_cache(self, req: Request, num_computed: int) -> bool:
        """Whether commit_computed would register a block: a block filled since the last commit."""
        if not self.caching:
            return False
        state = self._reqs.get(req.request_id)
        return state is not None and num_computed >= (state.num_cached + 1) * self.block_size

    def free(self, req: Request) -> None:
        """Gives back the request's blocks, last block first (see BlockPool.free)."""
        state = self._reqs.pop(req.request_id, None)
        if state is not None:
            self.pool.free(block for block in reversed(state.blocks) if block is not None)
            if self._this_step:  # (a preemption while scheduling) its blocks may go to anyone now
                self._this_step.clear()

    def free_and_forget(self, req: Request) -> None:
        """Frees the request's blocks like free(), but first drops from the prefix cache every block it
        computed itself: its logits went NaN (or its sampling failed otherwise), so the K/V it wrote may be
        garbage, and a later request must not reuse it (vLLM does the same).

        "Computed itself" means every block past its prefix hit at its latest admission. The hit blocks
        were computed by the requests they came from and stay cached: they are not this request's to
        judge. Its own blocks leave the index even when another request holds them too (a hit on them, in
        this step or since): that request keeps them, but nobody new can hit them or anything cached after
        them. (Blocks it computed before a preemption and then hit on again count as hit blocks.) So do the
        blocks a sliding window released, unless evicted since.
        """
        state = self._reqs.get(req.request_id)
        if state is not None and self.caching:
            self.pool.forget(block for block in state.blocks[state.num_hit:] if block is not None)
            self.pool.forget(block for block, epoch in zip(state.released, state.released_epochs)
                             if block.epoch == epoch)
        self.free(req)

    def block_ids(self, request_id: str) -> list[int]:
        state = self._reqs.get(request_id)
        # A block released by a sliding window maps to 0: attention never reads it (out of window).
        return [] if state is None else [b.block_id if b is not None else 0 for b in state.blocks]

    def num_blocks_held(self, request_id: str) -> int:
        state = self._reqs.get(request_id)
        return 0 if state is None else sum(block is not None for block in state.blocks)

    def block_map(self) -> list[tuple[str, str | None]]:
        owners: dict[int, str] = {}
        for request_id, state in self._reqs.items():
            for block in state.blocks:
                if block is not None:
                    owners.setdefault(block.block_id, request_id)
        return [("used", owners.get(b.block_id)) if b.ref_cnt > 0 else
                ("cached", None) if b.block_hash is not None else ("free", None) for b in self.pool.blocks]

    def reference_counts(self) -> dict[int, int]:
        """How many requests hold each block: what every block's ref_cnt must equal."""
        counts: dict[int, int] = {}
        for state in self._reqs.values():
            for block in state.blocks:
                if block is not None:
                    counts[block.block_id] = counts.get(block.block_id, 0) + 1
        return counts

    def _release_out_of_window(self, state: _RequestBlocks, num_computed: int) -> None:
        """Frees blocks no future query can see: the first new query sits at position num_computed.

        A released block keeps its prefix-cache identity until reused (BlockPool.free). With prefix caching
        a block is released only once committed to the cache, and the last committed one stays as the parent
        of the next (the chain is how hits are verified): asynchronous scheduling schedules the next step
        before this one's blocks are committed, and a block released (and reused) first would cut the
        request's chain; it is released a step later instead.
        """
        if self.sliding_window is None:
            return
        first_visible = num_computed - self.sliding_window + 1
        end = min(max(first_visible, 0) // self.block_size, len(state.blocks))
        if self.caching:
            end = min(end, state.num_cached - 1)
        for i in range(state.num_released, end):
            block = state.blocks[i]
            if block is not None:
                self.pool.free([block])
                state.blocks[i] = None
                if block.block_hash is not None and i >= state.num_hit:  # cached: reuse bumps its epoch
                    state.released.append(block)
                    state.released_epochs.append(block.epoch)
        state.num_released = max(state.num_released, end)

    def _cache_full_blocks(self, req: Request, state: _RequestBlocks, num_tokens: int) -> None:
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        if num_full <= state.num_cached:
            return
        self._extend_hashes(req, state, num_full)
        for i in range(state.num_cached, num_full):
            parent = state.blocks[i - 1] if i > 0 else self._root
            self.pool.cache_full_block(state.blocks[i], state.hashes[i], self._block_tokens(req, i), parent)
        state.num_cached = num_full

    def _extend_hashes(self, req: Request, state: _RequestBlocks, num_blocks: int) -> None:
        for i in range(len(state.hashes), num_blocks):
            parent_hash = state.hashes[i - 1] if i > 0 else self._root_hash
            state.hashes.append(self.pool.hash_fn(parent_hash, self._block_tokens(req, i)))

    def _block_tokens(self, req: Request, i: int) -> tuple[int, ...]:
        return tuple(req.all_token_ids[i * self.block_size:(i + 1) * self.block_size])
