"""The block pool: an O(1) free list in least-recently-freed order, ref counts, and a prefix cache
whose hits are verified by content, so even colliding hashes never hand out another prompt's KV."""
import pytest

from pagednb.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens


def cache_chain(pool, blocks, token_blocks):
    parent, parent_hash = None, None
    for block, tokens in zip(blocks, token_blocks):
        h = pool.hash_fn(parent_hash, tokens)
        pool.cache_full_block(block, h, tuple(tokens), parent)
        parent, parent_hash = block, h


def lookup_chain(pool, token_blocks):
    hits, parent, parent_hash = [], None, None
    for tokens in token_blocks:
        h = pool.hash_fn(parent_hash, tokens)
        block = pool.lookup(h, tuple(tokens), parent)
        if block is None:
            break
        hits.append(block)
        parent, parent_hash = block, h
    return hits


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.num_free == 4
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2]


def test_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(4, enable_caching=True)
    a, b, c, d = pool.allocate(4)
    assert pool.num_free_blocks == 0
    pool.free([c, a])
    pool.free([d])
    assert [blk.block_id for blk in pool.allocate(3)] == [c.block_id, a.block_id, d.block_id]


def test_allocating_more_than_free_raises():
    pool = BlockPool(2, enable_caching=False)
    with pytest.raises(RuntimeError, match="asked for 3 KV blocks, 2 free"):
        pool.allocate(3)


def test_ref_counts_and_double_free():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert pool.num_free_blocks == 1  # still held once
    pool.free([block])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([block])


def test_freed_blocks_keep_their_content_until_reallocated():
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.allocate(2)
    cache_chain(pool, blocks, [[1, 2], [3, 4]])
    pool.free(reversed(blocks))
    assert lookup_chain(pool, [[1, 2], [3, 4]]) == blocks  # cached free blocks still hit
    assert pool.num_cached_blocks == 2
    pool.touch(blocks[:1])  # a hit takes the block off the free list
    assert pool.num_free_blocks == 1
    (reused,) = pool.allocate(1)  # evicts the only free block: the tail one
    assert reused is blocks[1]
    assert lookup_chain(pool, [[1, 2], [3, 4]]) == blocks[:1]


def test_hits_are_verified_by_content_even_when_all_hashes_collide():
    pool = BlockPool(8, enable_caching=True, hash_fn=lambda parent, tokens: 42)
    first = pool.allocate(2)
    cache_chain(pool, first, [[1, 1], [2, 2]])  # prompt A = [1 1 | 2 2]
    second = pool.allocate(2)
    cache_chain(pool, second, [[9, 9], [3, 3]])  # prompt B = [9 9 | 3 3]
    assert lookup_chain(pool, [[1, 1], [3, 3]]) == first[:1]  # [1 1 | 3 3]: block 2 of B must not leak
    assert lookup_chain(pool, [[9, 9], [2, 2]]) == second[:1]
    assert lookup_chain(pool, [[1, 1], [2, 2]]) == first


def test_a_child_whose_parent_was_evicted_is_never_hit():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.allocate(2)
    cache_chain(pool, blocks, [[1, 2], [3, 4]])
    pool.free([blocks[0]])  # parent freed first, so it is evicted first
    pool.free([blocks[1]])
    pool.allocate(2)  # the never-used block, then the parent: parent content is gone
    cache_chain(pool, [blocks[0]], [[1, 2]])  # same content computed again in the same block
    assert blocks[0].epoch == 1
    assert lookup_chain(pool, [[1, 2], [3, 4]]) == [blocks[0]]


def test_chained_hash_depends_on_every_earlier_token():
    h1 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(hash_block_tokens(None, [1, 5]), [3, 4])


def test_integrity_check_catches_a_leak():
    pool = BlockPool(3, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.check_integrity({block.block_id: 1})
    with pytest.raises(AssertionError):
        pool.check_integrity({})  # nobody holds it, yet it is not free: a leak


def test_forget_drops_blocks_from_the_cache_even_while_held_and_orphans_their_children():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(2)
    cache_chain(pool, blocks, [[1, 2], [3, 4]])
    pool.touch(blocks[:1])  # another holder of the first block
    pool.forget(blocks[:1])
    assert lookup_chain(pool, [[1, 2], [3, 4]]) == []  # neither the block nor its child is reachable
    assert blocks[0].ref_cnt == 2  # holders keep it
    pool.free(blocks[::-1])
    pool.free(blocks[:1])
    pool.check_integrity({})
    assert pool.num_free_blocks == 4
