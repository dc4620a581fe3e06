"""Asynchronous scheduling: step N+1 is scheduled and launched before step N's tokens reach the host
(its decode inputs are read from N's sampled tokens on the device), then N is finished. Whatever the
stops, aborts and sampling options, the outputs equal the synchronous engine's, token for token; only
a row of a request that N stops is wasted. On CPU the launch is synchronous, but every bookkeeping path
is the same as on a GPU, where it is the default."""
import pytest

from pagednb import LLM, SamplingParams

PROMPTS = ["Tell me a story about a cat named Tom.", "Hello!", "What does a dog like?", "Once upon a time",
           "Tell me a story about a dog named Max."]


def run(async_scheduling: bool, params, prompts=PROMPTS, **kwargs):
    with LLM(async_scheduling=async_scheduling, **kwargs) as llm:
        assert llm.engine.async_scheduling is async_scheduling
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.check_integrity()
        assert llm.stats()["used_blocks"] == 0
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=60),  # the model's EOS ends most of these
    [SamplingParams(temperature=0, max_tokens=n) for n in (1, 2, 7, 40, 80)],
    SamplingParams(temperature=0, max_tokens=80, stop=["."]),  # stop strings end them mid-stream
    SamplingParams(temperature=0, max_tokens=80, stop_token_ids=[13, 20], ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=50, seed=7),
    SamplingParams(temperature=0, max_tokens=20, logprobs=3),
], ids=["eos", "max_tokens", "stop_strings", "stop_token_ids", "seeded", "logprobs"])
def test_outputs_equal_the_synchronous_engine(params):
    assert run(True, params) == run(False, params)


def test_chunked_prefill_and_preemption_under_a_tiny_pool():
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    kwargs = dict(num_kv_blocks=12, max_num_batched_tokens=16, max_model_len=96)
    with LLM(async_scheduling=True, **kwargs) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.stats()["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in run(False, params, **kwargs)]


def test_penalties_and_min_tokens_turn_the_overlap_off_and_still_match():
    """Their sampling reads every output token so far, so such steps run synchronously."""
    params = SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, min_tokens=5)
    with LLM(async_scheduling=True) as llm:
        engine = llm.engine
        engine.add_request("r", PROMPTS[0], params)
        engine.step()
        assert engine.needs_sync
    assert run(True, params) == run(False, params)


def test_aborts_between_steps_lose_nothing_and_free_everything():
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    with LLM(async_scheduling=True) as llm:
        engine = llm.engine
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, params)
        finals = {}
        for n in range(200):
            if n == 3:
                engine.abort_request(["r1", "r3"])
            if n == 9:
                engine.abort_request("r0")
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            engine.check_integrity()
            if not engine.has_unfinished_requests():
                break
        assert set(finals) == {f"r{i}" for i in range(len(PROMPTS))}
        assert [finals[r].outputs[0].finish_reason for r in ("r0", "r1", "r3")] == ["abort"] * 3
        assert [len(finals[r].outputs[0].token_ids) for r in ("r2", "r4")] == [64, 64]
        assert llm.stats()["used_blocks"] == 0


def test_a_step_that_fails_ends_its_requests_and_the_engine_goes_on():
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(async_scheduling=True) as llm:
        runner = llm.engine.runner
        real_collect, calls = runner.collect, {"n": 0}

        def collect(launched):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("injected device failure")
            return real_collect(launched)
        runner.collect = collect
        engine, finals = llm.engine, {}
        for i in range(2):
            engine.add_request(f"r{i}", PROMPTS[i], params)
        while engine.has_unfinished_requests():
            finals.update((out.request_id, out) for out in engine.step() if out.finished)
        runner.collect = real_collect
        assert [finals[r].outputs[0].finish_reason for r in ("r0", "r1")] == ["error", "error"]
        assert all("injected device failure" in str(finals[r].error) for r in ("r0", "r1"))
        again = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in again] == [30, 30]
        assert llm.stats()["used_blocks"] == 0
