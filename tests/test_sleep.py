"""Sleep mode on the CPU: weights really leave the model and come back identical, the KV pool is freed
and re-made the same size, generating while asleep or sleeping while busy is refused clearly, and greedy
outputs after waking equal those before (the GPU's memory check is in test_gpu_engine.py)."""
import asyncio

import pytest
import torch

from pagednb import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The cat named Tom", "What is 2 plus 3?"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def _snapshot(llm: LLM) -> dict[str, torch.Tensor]:
    model = llm.engine.runner.model
    return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def _token_ids(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(params=["llama", "qwen3"])
def llm(request, tiny_model_dir):
    # qwen3's tiny model ties its LM head to the embedding: the shared Parameter must survive the trip
    path = tiny_model_dir(request.param, tie_word_embeddings=request.param == "qwen3")
    with LLM(str(path), num_kv_blocks=64, max_model_len=256) as llm:
        yield llm


@pytest.mark.parametrize("level", [1, 2])
def test_round_trip_gives_the_same_weights_and_greedy_outputs(llm, level):
    before, weights = _token_ids(llm), _snapshot(llm)
    llm.sleep(level=level)
    assert llm.is_sleeping
    model = llm.engine.runner.model
    assert all(p.numel() == 0 for p in model.parameters())  # the weights really left the model
    assert llm.engine.runner.kv_caches == []
    llm.wake_up()
    assert not llm.is_sleeping
    restored = _snapshot(llm)
    assert restored.keys() == weights.keys()
    for name, tensor in weights.items():
        assert restored[name].dtype == tensor.dtype and restored[name].device == tensor.device, name
        assert torch.equal(restored[name], tensor), name
    assert _token_ids(llm) == before
    llm.engine.check_integrity()


def test_the_pool_is_re_made_the_same_size_and_the_prefix_cache_is_reset(llm):
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats["cached_blocks"] > 0
    shapes = [tuple(t.shape) for t in llm.engine.runner.kv_caches]
    llm.sleep()
    llm.wake_up()
    assert [tuple(t.shape) for t in llm.engine.runner.kv_caches] == shapes
    after = llm.stats()
    assert after["num_blocks"] == stats["num_blocks"]
    assert after["cached_blocks"] == 0 and after["free_blocks"] == after["num_blocks"]
    out = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # nothing from before the sleep is hit


def test_generating_while_asleep_raises_and_names_wake_up(llm):
    llm.sleep()
    with pytest.raises(RuntimeError, match=r"asleep.*wake_up\(\)"):
        llm.generate("Once upon a time", GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match=r"asleep.*wake_up\(\)"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)

    async def stream() -> None:
        async for _ in llm.stream("Once upon a time", GREEDY):
            pass

    with pytest.raises(RuntimeError, match=r"asleep.*wake_up\(\)"):
        asyncio.run(stream())
    llm.wake_up()
    assert llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].finished


def test_sleep_with_unfinished_requests_is_refused_naming_them_and_serving_goes_on(llm):
    engine = llm.engine
    ids = [engine.add_request(None, p, GREEDY) for p in PROMPTS]
    engine.step()
    with pytest.raises(RuntimeError, match=r"3 unfinished requests"):
        llm.sleep()
    assert not llm.is_sleeping
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {out.request_id for out in engine.step() if out.finished}
    assert finished == set(ids)
    llm.sleep()  # idle now
    assert llm.is_sleeping


def test_a_sleeping_engine_is_not_reported_as_holding_device_memory(llm):
    from pagednb.engine.live_engines import memory_of
    awake = memory_of(llm.engine)
    assert awake is not None and awake.kv_cache_bytes > 0
    llm.sleep()
    assert memory_of(llm.engine) is None  # a new engine's start-up report must not name this one
    llm.wake_up()
    assert memory_of(llm.engine) == awake


def test_sleep_and_wake_twice_are_harmless(llm):
    before = _token_ids(llm)
    llm.sleep()
    llm.sleep(level=2)  # already asleep: nothing happens (the level-1 copies stay)
    llm.wake_up()
    llm.wake_up()
    assert _token_ids(llm) == before


@pytest.mark.parametrize("level", [0, 3, True, "1", 1.5])
def test_a_bad_level_is_refused_naming_the_accepted_ones(llm, level):
    with pytest.raises(ValueError, match=r"level must be 1 .* or 2"):
        llm.sleep(level=level)
    assert not llm.is_sleeping


def test_waking_in_parts_is_refused_and_all_tags_wake_everything(llm):
    llm.sleep()
    with pytest.raises(ValueError, match=r"does not support waking in parts.*\['weights'\]"):
        llm.wake_up(tags=["weights"])
    assert llm.is_sleeping
    llm.wake_up(tags=["weights", "kv_cache"])
    assert not llm.is_sleeping and llm.engine.runner.kv_caches


def test_a_closed_engine_cannot_sleep(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=16, max_model_len=256)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.sleep()


def test_sleep_after_asynchronous_scheduling_drains_the_step_left_in_flight(tiny_model_dir):
    """With async scheduling, generate() may return while a step launched for its (now finished) requests
    is still in flight; sleep must finish it before the pool it writes into is freed."""
    with LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, max_model_len=256, async_scheduling=True) as llm:
        free_run = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids
        # a stop token the host learns of only after the next step was launched for that request
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[free_run[5]])
        before = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
        assert before == free_run[:6]
        assert llm.engine._in_flight  # the case under test: one launched step not yet collected
        llm.sleep()
        assert not llm.engine._in_flight and not llm.engine.has_unfinished_requests()
        llm.wake_up()
        assert llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids == before
        llm.engine.check_integrity()
