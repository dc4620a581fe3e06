"""The prefix-cache snapshot (llm.prefix_cache_snapshot()) as a tree of shared prefixes, and its view."""
import pytest

from pagednb import LLM, SamplingParams

BS = 8
S = list(range(10, 26))  # a shared 2-block prefix
X = list(range(40, 48))
Y = list(range(60, 68))
Z = list(range(80, 88))


@pytest.fixture
def llm(tiny_model_dir):
    with LLM(str(tiny_model_dir("llama")), num_kv_blocks=32, max_model_len=128, block_size=BS) as llm:
        yield llm


def run(llm, tokens):
    llm.generate(tokens, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)


def test_two_prompts_with_a_shared_prefix_make_one_branching_tree(llm):
    run(llm, S + X)
    run(llm, S + Y)
    snap = llm.prefix_cache_snapshot()
    (root,) = snap.roots()
    assert root.token_ids == tuple(S[:BS]) and root.depth == 0
    (second,) = snap.children(root.block_id)
    assert second.token_ids == tuple(S[BS:]) and second.depth == 1
    leaves = snap.children(second.block_id)
    assert sorted(leaf.token_ids for leaf in leaves) == [tuple(X), tuple(Y)]
    assert all(node.ref_cnt == 0 and node.reachable for node in snap.nodes)
    x_leaf = next(leaf for leaf in leaves if leaf.token_ids == tuple(X))
    y_leaf = next(leaf for leaf in leaves if leaf.token_ids == tuple(Y))
    # Freed tail first, and the second request took the prefix back off the free list: the unique
    # suffixes go before the shared prefix, the older suffix first.
    assert snap.eviction_order() == [x_leaf.block_id, y_leaf.block_id, second.block_id, root.block_id]
    free_order = [block.block_id for block in llm.engine.kv_cache_manager.pool.free_queue]
    assert [free_order.index(b) + 1 for b in snap.eviction_order()] == [
        snap_node.eviction_rank for snap_node in sorted(snap.nodes, key=lambda n: n.eviction_rank)]


def test_blocks_in_use_show_their_ref_count_and_no_eviction_rank(llm):
    run(llm, S + X)
    llm.pause()
    llm.engine.add_request("a", S + Z, SamplingParams(max_tokens=2, ignore_eos=True))
    llm.engine.add_request("b", S + Y, SamplingParams(max_tokens=2, ignore_eos=True))
    llm.debug_step()
    snap = llm.prefix_cache_snapshot()
    (root,) = snap.roots()
    (second,) = snap.children(root.block_id)
    assert (root.ref_cnt, second.ref_cnt) == (2, 2) and root.eviction_rank is None
    leaf_refs = {node.token_ids: node.ref_cnt for node in snap.children(second.block_id)}
    assert leaf_refs == {tuple(X): 0, tuple(Z): 1, tuple(Y): 1}
    llm.resume()
    while llm.engine.has_unfinished_requests():
        llm.debug_step()


def test_a_block_whose_prefix_was_evicted_is_shown_unreachable(llm):
    run(llm, S + X)
    snap = llm.prefix_cache_snapshot()
    (root,) = snap.roots()
    llm.engine.kv_cache_manager.pool.forget([llm.engine.kv_cache_manager.pool.blocks[root.block_id]])
    after = llm.prefix_cache_snapshot()
    assert root.block_id not in {node.block_id for node in after.nodes}
    (orphan,) = after.roots()
    assert orphan.token_ids == tuple(S[BS:]) and not orphan.reachable
    (leaf,) = after.children(orphan.block_id)
    assert leaf.token_ids == tuple(X) and not leaf.reachable and leaf.depth == 1


def test_the_view_draws_the_tree_and_ends_on_the_final_state(llm):
    import asyncio

    from pagednb.notebook import prefix_tree

    async def main():
        view = prefix_tree(llm, display=False)
        assert view.widget.tree["num_cached"] == 0 and view.live
        async for _ in llm.stream(S + X, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)):
            pass
        await asyncio.sleep(0.5)  # the view notices the idle engine and draws once more
        drawn = view.widget.tree
        view.stop()
        return drawn

    drawn = asyncio.run(main())
    snap = llm.prefix_cache_snapshot()
    tok = llm.engine.tokenizer
    assert drawn["num_cached"] == len(snap.nodes) == 3  # S's two blocks and X's: the final state
    order = snap.eviction_order()
    assert drawn["nodes"] == [[n.block_id, n.parent_id, tok.decode(list(n.token_ids)), n.ref_cnt,
                               order.index(n.block_id) + 1, n.reachable] for n in snap.nodes]
    assert [node[1] for node in drawn["nodes"]] == [None, drawn["nodes"][0][0], drawn["nodes"][1][0]]
