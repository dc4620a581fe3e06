"""The asynchronous face of the engine: streams on the running loop, sharing steps; leaving a stream
early aborts it; aborts from any thread; synchronous calls inside a running loop; failures that reach
their consumers; close() that ends everything. Each test runs its own loop with asyncio.run."""
import asyncio
import gc
import random
import threading
import weakref

import pytest

from pagednb import LLM, RequestOutputKind, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture
def llm(tiny_model_dir):
    engine = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, max_model_len=256)
    yield engine
    engine.close()


def fail_on_call(llm, call_number: int, error: BaseException):
    """Makes the model runner's step raise `error` on its call_number-th call; returns the undo function.
    (The runner, not the model's forward: a decode step on a GPU replays a CUDA graph instead.)"""
    runner = llm.engine.runner
    real_launch = runner.launch
    calls = {"n": 0}

    def launch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call_number:
            raise error
        return real_launch(*args, **kwargs)
    runner.launch = launch
    return lambda: setattr(runner, "launch", real_launch)


def settle(llm, steps=3):
    """Lets the background loop run a few steps' worth of turns."""
    async def wait():
        for _ in range(steps * 20):
            await asyncio.sleep(0)
    return wait()


def test_stream_yields_cumulative_text_and_deltas(llm):
    async def main():
        outs = [out async for out in llm.stream("Unicode text: café 🐱", GREEDY)]
        return outs
    outs = asyncio.run(main())
    assert len(outs) == 24 and outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert "".join(o.outputs[0].delta for o in outs) == outs[-1].outputs[0].text
    assert all(a.outputs[0].text.startswith(b.outputs[0].text) for a, b in zip(outs[1:], outs))
    assert llm.stats()["used_blocks"] == 0


def test_streams_share_steps_and_agenerate_returns_the_final_output(llm):
    alone = llm.generate(["The cat", "The dog", "Once upon"], GREEDY, use_tqdm=False)

    async def main():
        steps_before = llm.driver.num_steps
        results = await asyncio.gather(*(llm.agenerate(p, GREEDY) for p in ["The cat", "The dog", "Once upon"]))
        return results, llm.driver.num_steps - steps_before
    results, steps = asyncio.run(main())
    assert [r.outputs[0].token_ids for r in results] == [a.outputs[0].token_ids for a in alone]
    assert steps < 2 * 24  # three requests advanced together, not one after another


def test_breaking_out_of_a_stream_aborts_it_and_frees_its_blocks(llm):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        async for out in llm.stream("The cat", long, request_id="leaver"):
            if len(out.outputs[0].token_ids) == 3:
                break
        await settle(llm)
        return llm.stats()
    stats = asyncio.run(main())
    assert stats["used_blocks"] == 0 and stats["running"] == 0
    assert stats["cached_blocks"] >= 0


def test_cancelling_the_consuming_task_and_aclose_abort(llm):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        async def consume():
            async for _ in llm.stream("The cat", long):
                pass
        task = asyncio.create_task(consume())
        await settle(llm)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stream = llm.stream("The dog", long)
        await stream.__anext__()
        await stream.aclose()
        await settle(llm)
        return llm.stats()
    stats = asyncio.run(main())
    assert stats["running"] == stats["waiting"] == stats["used_blocks"] == 0


def test_abort_from_another_thread_ends_the_stream_within_two_steps(llm):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        marks = {}
        outs = []
        async for out in llm.stream("The cat", long, request_id="victim"):
            outs.append(out)
            if len(outs) == 5:
                marks["abort_step"] = llm.driver.num_steps
                threading.Thread(target=llm.abort, args=("victim",)).start()
        marks["end_step"] = llm.driver.num_steps
        return outs, marks
    outs, marks = asyncio.run(main())
    assert outs[-1].outputs[0].finish_reason == "abort"
    assert marks["end_step"] - marks["abort_step"] <= 2
    assert llm.stats()["used_blocks"] == 0


def test_sync_generate_inside_a_running_loop_keeps_background_streams_fed(llm):
    expected = llm.generate(["The cat", "The dog"], GREEDY, use_tqdm=False)

    async def main():
        stream = llm.stream("The cat", GREEDY)
        first = await stream.__anext__()
        sync_out = llm.generate("The dog", GREEDY, use_tqdm=False)  # blocks this loop, steps for everyone
        rest = [out async for out in stream]
        return first, rest, sync_out
    first, rest, sync_out = asyncio.run(main())
    assert rest[-1].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert sync_out[0].outputs[0].token_ids == expected[1].outputs[0].token_ids
    # The stream's consumer could not read during `generate`: no outputs piled up for it, and no token
    # was lost: it finished meanwhile, so its final output is the only one left, carrying everything.
    assert len(rest) == 1 and rest[0].finished
    assert first.outputs[0].delta + rest[0].outputs[0].delta == expected[0].outputs[0].text


def test_64_concurrent_streams_with_random_aborts_and_priorities(tiny_model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(1, 40))] for _ in range(64)]
    lengths = [rng.randint(1, 30) for _ in range(64)]
    # float32: on a GPU, bf16 rounding differs between batch compositions and may flip a greedy token
    with LLM(str(tiny_model_dir("llama")), num_kv_blocks=24, max_model_len=128, max_num_seqs=16,
             scheduling_policy="priority", dtype="float32") as llm:
        alone = [llm.generate(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids for p, n in zip(prompts, lengths)]
        to_abort = set(rng.sample(range(64), 16))

        async def one(i):
            params = SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True)
            final = None
            async for out in llm.stream(prompts[i], params, request_id=f"s{i}", priority=rng.randint(0, 3)):
                final = out
                if i in to_abort and len(out.outputs[0].token_ids) >= lengths[i] // 2:
                    llm.abort(f"s{i}")
            return final

        async def main():
            return await asyncio.gather(*(one(i) for i in range(64)))
        finals = asyncio.run(main())
        stats = llm.stats()
        llm.engine.check_integrity()
    assert all(f is not None and f.finished for f in finals)  # nothing lost
    for i, final in enumerate(finals):
        reason = final.outputs[0].finish_reason
        if reason == "abort":
            assert i in to_abort
        else:
            assert reason == "length" and final.outputs[0].token_ids == alone[i]
    assert stats["used_blocks"] == 0 and stats["preemptions"] > 0


def test_a_failing_model_step_reaches_every_consumer_and_the_engine_recovers(llm):
    async def main():
        async def consume(prompt):
            try:
                async for _ in llm.stream(prompt, GREEDY):
                    pass
            except RuntimeError as error:
                return error
        return await asyncio.gather(consume("The cat"), consume("The dog"))
    undo = fail_on_call(llm, 3, RuntimeError("injected kernel failure"))
    errors = asyncio.run(main())
    undo()
    assert [str(e) for e in errors] == ["injected kernel failure"] * 2
    assert llm.stats()["used_blocks"] == 0
    again = llm.generate("The cat", GREEDY, use_tqdm=False)[0]  # the engine goes on serving
    assert again.outputs[0].finish_reason == "length"
    llm.close()
    assert llm.engine.closed


def test_keyboard_interrupt_during_sync_generate_aborts_its_requests_only(llm):
    expected = llm.generate("The cat", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    undo = fail_on_call(llm, 5, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["The cat", "The dog"], GREEDY, use_tqdm=False)
    undo()
    assert llm.stats()["used_blocks"] == 0 and not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert llm.generate("The cat", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_close_ends_open_streams_and_stops_the_loop(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=32, max_model_len=256)

    async def main():
        stream = llm.stream("The cat", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        task = llm.driver.background_task
        llm.close()
        rest = [out async for out in stream]
        await asyncio.sleep(0)
        return rest, task
    rest, task = asyncio.run(main())
    assert rest[-1].outputs[0].finish_reason == "abort"
    assert task.done() and llm.engine.closed and llm.engine.runner.kv_caches == []


def suspended_on(task: asyncio.Task):
    """The innermost object the task's coroutine waits on: the same object for as long as the task sleeps,
    a new one each time it wakes (to poll, or to spin through `sleep(0)`)."""
    awaited = task.get_coro()
    while getattr(awaited, "cr_await", None) is not None:
        awaited = awaited.cr_await
    return awaited


def test_the_loop_sleeps_when_idle(llm):
    async def main():
        await llm.agenerate("The cat", GREEDY)
        await settle(llm)  # the loop task's last turns: it finds nothing queued and goes to sleep
        task, steps = llm.driver.background_task, llm.driver.num_steps
        asleep_on = suspended_on(task)
        await asyncio.sleep(0.2)
        return llm.driver.num_steps - steps, not task.done() and suspended_on(task) is asleep_on
    extra_steps, slept_throughout = asyncio.run(main())
    assert extra_steps == 0 and slept_throughout  # no spinning while nothing is queued: not a single wake-up


def test_breaking_out_of_a_stream_still_referenced_aborts_it(llm):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = llm.stream("The cat", long, request_id="kept")  # still referenced after the loop
        async for out in stream:
            if len(out.outputs[0].token_ids) == 2:
                break
        await settle(llm)
        return stream, llm.stats()
    stream, stats = asyncio.run(main())
    assert stats["used_blocks"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    assert llm.driver.consumer_ids() == []


def test_async_with_aborts_when_the_block_is_left_whatever_happened(llm):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        async with llm.stream("The cat", long) as stream:
            first = await stream.__anext__()  # read without an iterator: only the block can abort
        await settle(llm)
        after_leaving = llm.stats()
        with pytest.raises(ValueError):
            async with llm.stream("The dog", long) as failing:
                await failing.__anext__()
                raise ValueError("the consumer failed")
        await settle(llm)
        rest = [out async for out in stream]  # an aborted stream has nothing more to give
        return first, after_leaving, llm.stats(), rest
    first, after_leaving, after_failing, rest = asyncio.run(main())
    assert not first.finished and rest == []
    for stats in (after_leaving, after_failing):
        assert stats["used_blocks"] == 0 and stats["running"] == 0 and stats["waiting"] == 0


async def collect(stream) -> list:
    return [out async for out in stream]


def test_a_failing_consumer_is_aborted_alone(llm):
    expected = llm.generate("The dog", GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    async def main():
        healthy = llm.stream("The dog", GREEDY)
        broken = llm.engine.make_request(None, "The cat", SamplingParams(temperature=0, max_tokens=200))
        llm.driver.submit(broken, lambda out: 1 / 0)  # a consumer that raises on its first output
        outs = await asyncio.wait_for(collect(healthy), 30)
        await settle(llm)
        return outs, llm.stats()
    outs, stats = asyncio.run(main())
    assert outs[-1].outputs[0].token_ids == expected
    assert stats["used_blocks"] == 0 and stats["running"] == 0 and llm.driver.consumer_ids() == []


def test_a_stream_whose_loop_closed_is_aborted_by_the_next_step(llm):
    loop = asyncio.new_event_loop()
    stream = loop.run_until_complete(_open_stream(llm))
    loop.run_until_complete(_cancel_all(loop))
    loop.close()  # the stream's request is still queued; its consumer's loop is gone
    out = llm.generate("The dog", GREEDY, use_tqdm=False)[0]  # steps on this thread, for everyone
    assert out.outputs[0].finish_reason == "length"
    assert llm.stats()["running"] == 0 and llm.stats()["used_blocks"] == 0
    del stream


async def _open_stream(llm):
    return llm.stream("The cat", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))


async def _cancel_all(loop):
    tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _memory_refs(llm):
    runner = llm.engine.runner
    return [weakref.ref(runner.kv_caches[0]), weakref.ref(next(runner.model.parameters()))]


def _stream_on_a_loop_left_open(llm) -> asyncio.AbstractEventLoop:
    """A stream consumed by a loop that then stops but stays open: the engine's loop task waits on it."""
    async def consume():
        async for _ in llm.stream("The cat", GREEDY):
            pass
    loop = asyncio.new_event_loop()
    loop.run_until_complete(consume())
    assert not llm.driver.background_task.done()
    return loop


def test_del_gives_the_memory_back_and_asyncio_logs_nothing(tiny_model_dir, caplog):
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, max_model_len=256)
    loop = _stream_on_a_loop_left_open(llm)
    refs = _memory_refs(llm)
    del llm  # no close(), no gc.collect() here
    assert [ref() for ref in refs] == [None, None]  # the KV cache and the weights are freed at once
    loop.close()
    gc.collect()
    assert "Task was destroyed but it is pending" not in caplog.text


def test_close_of_a_dropped_but_referenced_engine_gives_the_memory_back(tiny_model_dir, caplog):
    """A re-run cell drops `llm`, but the notebook's output history still holds the LLM."""
    history = [LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, max_model_len=256)]
    loop = _stream_on_a_loop_left_open(history[0])
    refs = _memory_refs(history[0])
    history[0].close()
    assert [ref() for ref in refs] == [None, None] and history[0].engine.closed
    loop.close()
    gc.collect()
    assert "Task was destroyed but it is pending" not in caplog.text


def test_del_while_the_loop_runs_finishes_the_loop_task(tiny_model_dir, caplog):
    async def main():
        llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, max_model_len=256)
        async for _ in llm.stream("The cat", GREEDY):
            pass
        task, refs = llm.driver.background_task, _memory_refs(llm)
        del llm
        await asyncio.sleep(0)
        return task, [ref() for ref in refs]
    loop = asyncio.new_event_loop()
    task, alive = loop.run_until_complete(main())
    assert task.cancelled() and alive == [None, None]
    loop.close()
    gc.collect()
    assert "Task was destroyed but it is pending" not in caplog.text


# ---- a consumer slower than the engine: outputs merge instead of piling up --------------------------
DELTA = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


def count_built_outputs(llm) -> dict[str, int]:
    """Counts the outputs the engine builds per request id (what the host pays for each step)."""
    built: dict[str, int] = {}
    real_step = llm.engine.step

    def step():
        outputs = real_step()
        for out in outputs:
            built[out.request_id] = built.get(out.request_id, 0) + 1
        return outputs
    llm.engine.step = step
    return built


async def read_slowly(stream, turns: int) -> list:
    """Reads the stream, leaving the loop `turns` turns (the engine steps meanwhile) after each output."""
    outs = []
    async for out in stream:
        outs.append(out)
        for _ in range(turns):
            await asyncio.sleep(0)
    return outs


@pytest.mark.parametrize("with_stop", [False, True])
def test_a_slow_consumer_gets_merged_deltas_that_join_to_the_whole_text(llm, with_stop):
    whole = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    stop = None
    if with_stop:  # a stop string from the middle of the text: found at once although nobody reads then
        text = llm.generate("Once upon a time", whole, use_tqdm=False)[0].outputs[0].text
        stop = [text[len(text) // 2:len(text) // 2 + 3]]
        whole = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA,
                            stop=stop)
    expected = llm.generate(["Once upon a time"], whole, use_tqdm=False)[0].outputs[0]
    assert expected.stop_reason == (stop[0] if stop else None)
    built = count_built_outputs(llm)

    async def main():
        stream = llm.stream("Once upon a time", params)
        return await read_slowly(stream, turns=4), stream.request_id
    outs, request_id = asyncio.run(main())
    assert 1 < len(outs) < len(expected.token_ids)  # several steps' tokens per output
    assert built[request_id] == len(outs)  # none was built that nobody read
    assert "".join(o.outputs[0].text for o in outs) == expected.text
    assert [t for o in outs for t in o.outputs[0].token_ids] == expected.token_ids
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == expected.finish_reason
    assert outs[-1].outputs[0].stop_reason == expected.stop_reason
    assert llm.stats()["used_blocks"] == 0


def test_a_fast_consumer_still_gets_one_output_per_step(llm):
    async def main():
        return await read_slowly(llm.stream("The cat", DELTA), turns=0)
    outs = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 24


def test_paced_stream_builds_one_output_per_interval_and_the_final_one_at_once(llm):
    expected = llm.generate(["The dog"], GREEDY, use_tqdm=False)
    built = count_built_outputs(llm)

    async def main():
        streams = [llm.stream("The dog", DELTA), llm.stream("The cat", SamplingParams(
            n=2, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA))]
        for stream in streams:
            stream.pace(3600.0)  # nothing but the first and the final output can come
        results = await asyncio.gather(*(read_slowly(s, turns=0) for s in streams))
        return results, [s.request_id for s in streams]
    (single, family), ids = asyncio.run(main())
    assert len(single) == 2 and single[-1].finished  # the first tokens at once, then the rest at the end
    assert "".join(o.outputs[0].text for o in single) == expected[0].outputs[0].text
    assert built[ids[0]] == 2
    alone = llm.generate("The cat", SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0]
    for c in alone.outputs:  # each completion's deltas join to its text; at most first + final outputs
        deltas = [d for o in family for d in o.outputs if d.index == c.index]
        assert "".join(d.text for d in deltas) == c.text and len(deltas) <= 2
    assert family[-1].finished and built[ids[1]] == len(family)
    assert llm.stats()["used_blocks"] == 0
