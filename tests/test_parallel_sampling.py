"""SamplingParams(n > 1), as vLLM v1 does it: one prompt, n completions with .index 0..n-1, the
prompt's full blocks computed once and shared (stats), completion i seeded seed + i (so identical
alone or in any batch), greedy n=2 equal to n=1, streaming deltas per completion that join to the
final texts, aborting the parent id ends all n and frees every block, a failing child ends the parent
with its error; with prefix caching off each child computes the prompt itself (documented)."""
from __future__ import annotations

import asyncio

import pytest

from pagednb import LLM, RequestOutputKind, SamplingParams
from pagednb.request import SamplingError

BLOCK = 16


pytestmark = pytest.mark.usefixtures("pool_checked_after_each_test")


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    # float32 on the CPU, synchronous: these tests count outputs step by step, poison logits through the
    # model's Python compute_logits and compare completions bit for bit across batch compositions and
    # recomputation (the asynchronous-scheduling test below runs on the GPU where there is one)
    engine = LLM(str(tiny_model_dir("llama")), num_kv_blocks=128, max_model_len=256, device="cpu",
                 async_scheduling=False)
    yield engine
    engine.close()


def prompt_ids(seed: int, length: int, vocab: int) -> list[int]:
    """A token-id prompt no other test uses, so nothing of it is in the prefix cache yet."""
    return [(seed * 7919 + i * 104729) % (vocab - 1) + 1 for i in range(length)]


def delta(before: dict, after: dict, key: str) -> int:
    return after[key] - before[key]


def test_n_completions_share_the_prompt_computed_once(llm):
    vocab = llm.engine.spec.vocab_size
    n, length, max_tokens = 4, 3 * BLOCK + 5, 8  # 3 full prompt blocks, a partial one
    prompt = prompt_ids(1, length, vocab)
    before = llm.stats()
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=5),
                       use_tqdm=False)
    after = llm.stats()
    assert len(out) == 1 and out[0].finished
    assert [c.index for c in out[0].outputs] == list(range(n))
    assert all(len(c.token_ids) == max_tokens and c.finish_reason == "length" for c in out[0].outputs)
    # The first child computes the whole prompt; the others hit its 3 full blocks and compute only the
    # partial block (whose last token gives each its first token). Then n x (max_tokens - 1) decodes.
    partial = length - 3 * BLOCK
    assert delta(before, after, "computed_tokens") == length + (n - 1) * partial + n * (max_tokens - 1)
    assert delta(before, after, "prefix_cache_hit_tokens") == (n - 1) * 3 * BLOCK
    assert delta(before, after, "generated_tokens") == n * max_tokens


def test_blocks_of_the_prompt_are_held_once_while_running(llm):
    vocab = llm.engine.spec.vocab_size
    n, length = 3, 4 * BLOCK + 1
    engine = llm.engine
    engine.add_request("fam", prompt_ids(2, length, vocab),
                       SamplingParams(n=n, temperature=1.0, max_tokens=4, ignore_eos=True))
    engine.step()  # all three admitted in one step
    used = llm.stats()["used_blocks"]
    # 4 shared full blocks + one block of its own per child (partial prompt block, then its outputs)
    assert used == 4 + n
    assert llm.block_map().count(("used", "0_fam")) == 5
    while engine.has_unfinished_requests():
        engine.step()


def test_completions_differ_and_seeded_ones_do_not_depend_on_the_batch(llm):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True, seed=123)
    alone = llm.generate("The cat sat", params, use_tqdm=False)[0]
    texts = [c.token_ids for c in alone.outputs]
    assert len({tuple(t) for t in texts}) > 1  # temperature 1 on a random model: not all alike
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    mixed = llm.generate(["Once upon", "The cat sat", "A dog", "x y z"],
                         [others, params, others, SamplingParams(n=3, temperature=0.7, max_tokens=5)],
                         use_tqdm=False)
    assert [c.token_ids for c in mixed[1].outputs] == texts
    assert [c.text for c in mixed[1].outputs] == [c.text for c in alone.outputs]
    # completion i is what n=1 with seed + i gives (vLLM's rule)
    for i in (0, 2):
        single = llm.generate("The cat sat", SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True,
                                                            seed=123 + i), use_tqdm=False)[0]
        assert single.outputs[0].token_ids == texts[i]


def test_greedy_n2_gives_identical_completions_equal_to_n1(llm):
    one = llm.generate("The dog named Max", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    two = llm.generate("The dog named Max", SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0].outputs
    assert [c.token_ids for c in two] == [one.token_ids, one.token_ids]
    assert [c.text for c in two] == [one.text, one.text]


def test_aborting_the_parent_id_ends_all_n_and_frees_every_block(llm):
    engine = llm.engine
    engine.add_request("keep", "A story about", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.add_request("many", "Abort this one", SamplingParams(n=5, temperature=1.0, max_tokens=50,
                                                                ignore_eos=True))
    engine.step()
    engine.step()
    assert llm.stats()["running"] == 6
    engine.abort_request("many")
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        engine.check_integrity()
    final = outs["many"][-1]
    assert final.finished and len(final.outputs) == 5
    assert all(c.finish_reason == "abort" and c.finished() for c in final.outputs)
    assert outs["keep"][-1].outputs[0].finish_reason == "length"
    assert llm.stats()["used_blocks"] == 0
    engine.add_request("many", "the id is free again", SamplingParams(max_tokens=1))  # nothing left behind
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_stream_deltas_per_completion_join_to_the_final_texts(llm, kind):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=15, seed=9, output_kind=kind)
    expected = llm.generate("Stream me", params, use_tqdm=False)[0]

    async def main():
        return [out async for out in llm.stream("Stream me", params)]
    outs = asyncio.run(main())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    joined = {i: "" for i in range(3)}
    joined_ids = {i: [] for i in range(3)}
    for out in outs:
        indices = [c.index for c in out.outputs]
        assert indices == sorted(set(indices))  # ordered by index, each at most once
        if kind is RequestOutputKind.CUMULATIVE:
            assert indices == [0, 1, 2]
        for c in out.outputs:
            joined[c.index] += c.delta
            if kind is RequestOutputKind.DELTA:
                assert c.text == c.delta
                joined_ids[c.index] += c.token_ids
    assert [joined[i] for i in range(3)] == [c.text for c in expected.outputs]
    if kind is RequestOutputKind.DELTA:
        assert [joined_ids[i] for i in range(3)] == [c.token_ids for c in expected.outputs]
    else:
        assert [c.text for c in outs[-1].outputs] == [c.text for c in expected.outputs]


def test_delta_outputs_carry_only_the_completions_that_changed(llm):
    engine = llm.engine
    engine.add_request("d", "delta family", SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True,
                                                           output_kind=RequestOutputKind.DELTA))
    first = engine.step()
    assert [c.index for c in first[0].outputs] == [0, 1, 2]
    engine.abort_request("1_d")  # one child alone (its id, as vLLM names it)
    per_step = [out for _ in range(3) for out in engine.step() if out.request_id == "d"]
    aborted, advanced = per_step[0], per_step[1:]  # (aborts are applied, and output, before the step)
    assert [(c.index, c.finish_reason) for c in aborted.outputs] == [(1, "abort")] and not aborted.finished
    assert len(advanced) == 3 and all([c.index for c in out.outputs] == [0, 2] for out in advanced)
    while engine.has_unfinished_requests():
        engine.step()


def test_final_only_and_generate_return_one_output_with_n_completions(llm):
    engine = llm.engine
    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("fo", "final only", params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs) == 2


class poisoned_child:
    """NaN logits for the second completion ("1_<parent>") of every n > 1 request from its second
    output token on, by wrapping the runner's launch and the model's compute_logits."""

    def __init__(self, llm):
        self.runner = llm.engine.runner
        self.real = self.runner.launch, self.runner.model.compute_logits
        self.row = None

    def launch(self, sched, *args):
        rows = [s.request for s in sched.scheduled if s.samples]
        self.row = next((i for i, r in enumerate(rows) if r.request_id.startswith("1_")
                         and r.num_output_tokens + r.num_pending_tokens == 2), None)
        return self.real[0](sched, *args)

    def compute_logits(self, hidden):
        logits = self.real[1](hidden)
        if self.row is not None:
            logits = logits.clone()
            logits[self.row] = float("nan")
        return logits

    def __enter__(self):
        self.runner.launch, self.runner.model.compute_logits = self.launch, self.compute_logits

    def __exit__(self, *exc):
        self.runner.launch, self.runner.model.compute_logits = self.real


def test_a_failing_child_ends_the_parent_with_its_error(llm):
    engine = llm.engine
    family = SamplingParams(n=3, temperature=1.0, max_tokens=30, ignore_eos=True)
    with poisoned_child(llm):
        engine.add_request("bad", "poisoned family", family)
        engine.add_request("fine", "a bystander", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        bad = finals["bad"]
        assert isinstance(bad.error, SamplingError)
        assert [c.finish_reason for c in bad.outputs] == ["abort", "error", "abort"]
        assert [len(c.token_ids) for c in bad.outputs] == [2, 1, 2]  # siblings aborted in the same step
        assert finals["fine"].outputs[0].finish_reason == "length" and finals["fine"].error is None
        with pytest.raises(SamplingError):  # generate raises it, as for any failed request
            llm.generate("poisoned family", family, use_tqdm=False)


def test_n_and_best_of_are_checked(llm):
    for bad in (0, -1, 4097):
        with pytest.raises(ValueError, match=r"n must be an int in \[1, 4096\]"):
            SamplingParams(n=bad)
    with pytest.raises(TypeError, match="n must be"):
        SamplingParams(n=2.5)
    with pytest.raises(ValueError, match="pagednb does not support best_of"):
        SamplingParams(n=2, best_of=4)
    with pytest.raises(ValueError, match="seed must be"):
        SamplingParams(n=3, seed=2**64 - 2)
    assert SamplingParams(n=3.0).n == 3
    engine = llm.engine
    engine.add_request("0_taken", "a", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):  # a child's id would collide
        engine.add_request("taken", "b", SamplingParams(n=2, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    rid = engine.add_request(None, "automatic id", SamplingParams(n=2, max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(f"1_{rid}", "c", SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def test_without_prefix_caching_each_child_computes_the_prompt(tiny_model_dir):
    """Documented behaviour (as vLLM, whose n > 1 sharing also rides on prefix caching): with
    enable_prefix_caching=False nothing is shared; n children compute n prompts. Outputs are the same."""
    with LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, max_model_len=256,
             enable_prefix_caching=False) as llm:
        prompt = prompt_ids(3, 2 * BLOCK + 3, llm.engine.spec.vocab_size)
        params = SamplingParams(n=3, temperature=1.0, max_tokens=4, ignore_eos=True, seed=1)
        before = llm.stats()
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        after = llm.stats()
        assert delta(before, after, "computed_tokens") == 3 * len(prompt) + 3 * 3
        llm.engine.check_integrity()
        with LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, max_model_len=256) as cached:
            shared = cached.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in shared.outputs]


def test_asynchronous_scheduling_gives_the_same_completions(tiny_model_dir, llm):
    """With the host a step ahead (the GPU default; forced here on the CPU), children still fan in right."""
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=77)
    expected = [c.token_ids for c in llm.generate("async family", params, use_tqdm=False)[0].outputs]
    with LLM(str(tiny_model_dir("llama")), num_kv_blocks=128, max_model_len=256, device="cpu",
             async_scheduling=True) as other:
        got = other.generate(["async family", "x"], [params, SamplingParams(max_tokens=3)], use_tqdm=False)
        assert [c.token_ids for c in got[0].outputs] == expected
        assert other.stats()["used_blocks"] == 0
        other.engine.check_integrity()


def test_children_preempted_under_memory_pressure_give_the_same_completions(tiny_model_dir, llm):
    """A pool too small for all n at once: children are preempted and recomputed (sharing the prompt
    again through the cache), and each completion still equals the roomy pool's."""
    params = SamplingParams(n=4, temperature=1.0, max_tokens=40, ignore_eos=True, seed=11)
    prompt = {"prompt_token_ids": prompt_ids(4, 2 * BLOCK + 2, llm.engine.spec.vocab_size)}
    expected = [c.token_ids for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs]
    with LLM(str(tiny_model_dir("llama")), num_kv_blocks=8, max_model_len=128, device="cpu") as small:
        got = small.generate(prompt, params, use_tqdm=False)[0]
        assert small.stats()["preemptions"] > 0
        assert [c.token_ids for c in got.outputs] == expected
        assert small.stats()["used_blocks"] == 0
        small.engine.check_integrity()
