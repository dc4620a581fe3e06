"""The step debugger's engine side: StepReport contents against the engine's own state, pausing the
background driver, and the zero-cost rule (no recorder attached while nobody listens)."""
import asyncio

import pytest
from gpu_support import gpu

from pagednb import LLM, SamplingParams

BS = 8  # block size of every engine here


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def prompt(n: int, first: int = 10) -> list[int]:
    return list(range(first, first + n))


def blocks(tokens: int) -> int:
    return -(-tokens // BS)


@pytest.fixture
def make_llm(tiny_model_dir):
    made = []

    def make(**options):
        # on the CPU: these specify synchronous steps (a GPU's asynchronous ones are test_gpu_... below)
        options = {"device": "cpu", "num_kv_blocks": 64, "max_model_len": 128, "block_size": BS, **options}
        made.append(LLM(str(tiny_model_dir("llama")), **options))
        return made[-1]

    yield make
    for llm in made:
        llm.close()


def step_until_idle(llm):
    reports = []
    while llm.engine.has_unfinished_requests():
        reports.append(llm.debug_step())
        llm.engine.check_integrity()
    return reports


def test_batch_rows_budget_and_block_tables_match_the_engine(make_llm):
    llm = make_llm(max_num_batched_tokens=32)
    a = llm.engine.add_request("a", prompt(20), params(3))
    b = llm.engine.add_request("b", prompt(9, first=40), params(3))
    c = llm.engine.add_request("c", prompt(12, first=70), params(3))

    first = llm.debug_step()
    kv = llm.engine.kv_cache_manager
    assert [(r.request_id, r.kind, r.start, r.num_tokens) for r in first.rows] == [
        (a, "prefill", 0, 20), (b, "prefill", 0, 9), (c, "prefill", 0, 3)]  # c: a chunk of 3, the budget's rest
    assert [r.samples for r in first.rows] == [True, True, False]
    assert first.num_batched_tokens == 32 == first.max_num_batched_tokens
    assert first.num_running == 3 and first.max_num_seqs == llm.engine.config.max_num_seqs
    assert first.blocks_allocated == blocks(20) + blocks(9) + blocks(3) and first.blocks_hit == 0
    assert first.blocks_freed == 0 and first.preemptions == () and first.waiting == ()
    assert first.block_tables == {rid: tuple(kv.block_ids(rid)) for rid in (a, b, c)}
    assert first.pool_after.used == first.pool_before.used + first.blocks_allocated
    assert first.pool_after.used == llm.stats()["used_blocks"]

    second = llm.debug_step()
    assert [(r.request_id, r.kind, r.start, r.num_tokens) for r in second.rows] == [
        (a, "decode", 20, 1), (b, "decode", 9, 1), (c, "prefill", 3, 9)]
    assert second.num_batched_tokens == 11
    assert second.blocks_allocated == blocks(12) - blocks(3)  # c's chunk crosses into its second block
    assert second.rows[2].new_block_ids == tuple(kv.block_ids(c)[1:])
    assert "2 decode" in second.summary() and "11 of 32 tokens" in second.summary()
    step_until_idle(llm)


def test_finished_requests_free_their_blocks_in_the_same_report(make_llm):
    llm = make_llm()
    rid = llm.engine.add_request(None, prompt(17), params(1))
    report = llm.debug_step()  # a CPU step is synchronous: prefill, sample, finish (max_tokens=1)
    assert report.finished == ((rid, "length"),)
    assert report.blocks_allocated == blocks(17) == report.blocks_freed
    assert report.pool_after.used == 0 and report.pool_after.free == llm.stats()["free_blocks"]


def test_prefix_cache_hits_are_counted_in_blocks_and_tokens(make_llm):
    llm = make_llm()
    shared = prompt(24)
    llm.engine.add_request("first", shared, params(1))
    step_until_idle(llm)
    llm.engine.add_request("second", shared + prompt(5, first=90), params(1))
    report = llm.debug_step()
    (row,) = report.rows
    assert row.admitted and row.cached_tokens == 24 and row.start == 24 and row.num_tokens == 5
    assert report.blocks_hit == 3 and report.blocks_allocated == blocks(29) - 3
    assert row.new_block_ids[:3] == report.block_tables["second"][:3]
    assert llm.stats()["prefix_cache_hit_tokens"] == 24


def test_preemption_reports_the_victim_and_why(make_llm):
    # 4 blocks; two 15-token prompts take 2 blocks each; a's 17th token needs a third block: b is preempted.
    llm = make_llm(num_kv_blocks=4, max_model_len=32, enable_prefix_caching=False)
    a = llm.engine.add_request("a", prompt(15), params(8))
    b = llm.engine.add_request("b", prompt(15, first=40), params(8))
    reports = []
    while not (reports and reports[-1].preemptions):
        reports.append(llm.debug_step())
        assert len(reports) < 5, "no preemption happened"
    report = reports[-1]
    (preemption,) = report.preemptions
    assert preemption.request_id == b
    assert preemption.reason == f"out of blocks: request {a!r} needed 1 block, 0 free"
    assert preemption.blocks_freed == 2 and report.blocks_freed == 2
    assert [(r.request_id, r.kind, len(r.new_block_ids)) for r in report.rows] == [(a, "decode", 1)]
    assert report.waiting == (b,) and "preemption" in report.waiting_reason
    assert set(report.block_tables) == {a}
    assert llm.stats()["preemptions"] == 1
    after = llm.debug_step()  # a holds 3 blocks now; b must recompute all its tokens from scratch
    victim = llm.engine.scheduler.requests[b]
    assert after.waiting == (b,) and after.waiting_reason == (
        f"out of blocks: request {b!r} needs {blocks(victim.num_tokens)} free blocks for its next "
        f"{victim.num_tokens} tokens, 1 free")
    every = reports + [after] + step_until_idle(llm)
    # every reference taken (a fresh block or a prefix hit) was dropped again by the end
    assert sum(r.blocks_allocated + r.blocks_hit for r in every) == sum(r.blocks_freed for r in every) > 0


def test_waiting_reason_names_the_limit_that_held_the_queue(make_llm):
    llm = make_llm(max_num_seqs=1)
    llm.engine.add_request("a", prompt(5), params(2))
    llm.engine.add_request("b", prompt(5, first=30), params(2))
    report = llm.debug_step()
    assert [r.request_id for r in report.rows] == ["a"]
    assert report.waiting == ("b",) and report.waiting_reason == "max_num_seqs=1 requests already running"
    step_until_idle(llm)


def test_nothing_is_recorded_while_nobody_listens(make_llm):
    llm = make_llm()
    assert llm.engine.step_recorder is None
    llm.debug_step()
    assert llm.engine.step_recorder is None  # debug_step attaches a recorder for its step only
    seen = []
    stop = llm.on_step(seen.append)
    llm.generate(prompt(6), params(3), use_tqdm=False)
    stop()
    assert llm.engine.step_recorder is None
    assert [r.step for r in seen] == list(range(seen[0].step, seen[0].step + len(seen)))
    assert sum(r.num_batched_tokens for r in seen) == 6 + 2 and seen[-1].finished


def test_a_paused_engine_queues_streams_and_steps_only_when_asked(make_llm):
    llm = make_llm()

    async def main():
        llm.pause()
        stream = llm.stream(prompt(6), params(2))
        outs = []
        consumer = asyncio.ensure_future(_collect(stream, outs))
        await asyncio.sleep(0.05)  # the background task would have finished the request by now
        waiting_while_paused = llm.stats()["waiting"]
        report = llm.debug_step()
        await asyncio.sleep(0.05)
        running_after_one_step = llm.stats()["running"]
        llm.resume()
        await asyncio.wait_for(consumer, 10)
        return waiting_while_paused, report, running_after_one_step, outs

    waiting, report, running, outs = asyncio.run(main())
    assert waiting == 1 and [r.num_tokens for r in report.rows] == [6] and running == 1
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2
    assert not llm.paused


def test_generate_refuses_to_wait_on_a_paused_engine(make_llm):
    llm = make_llm()
    llm.pause()
    with pytest.raises(RuntimeError, match="paused by the step debugger.*llm.resume"):
        llm.generate(prompt(4), params(2), use_tqdm=False)
    assert llm.stats()["waiting"] == 0 and llm.stats()["running"] == 0  # nothing was queued
    llm.resume()
    assert llm.generate(prompt(4), params(2), use_tqdm=False)[0].finished


async def _collect(stream, outs):
    async for out in stream:
        outs.append(out)


# ---- the widget's Python side (the browser side: tests/test_browser_debugger.py) -------------------
def test_step_view_buttons_drive_the_engine_and_draw_each_report(make_llm):
    pytest.importorskip("anywidget", reason="the notebook extra (pagednb[notebook]) is not installed")
    from pagednb.notebook import step_view

    llm = make_llm()

    async def main():
        view = step_view(llm, display=False, max_tokens=3)
        assert llm.paused and llm.engine.step_recorder is not None  # listening while paused only
        rid = view.add("Once upon a time")
        assert view.widget.status["waiting"] == 1 and view.widget.report == {}
        view._on_message(view.widget, {"action": "step"}, [])  # what a click on Step sends
        drawn = view.widget.report
        assert drawn["step"] == view.last_report.step
        assert [(r["request_id"], r["kind"], r["num_tokens"]) for r in drawn["rows"]] == [
            (rid, "prefill", llm.engine.scheduler.requests[rid].num_prompt_tokens)]
        assert drawn["labels"] == {rid: "Once upon a time"}
        assert drawn["block_tables"] == {rid: list(llm.engine.kv_cache_manager.block_ids(rid))}
        view._on_message(view.widget, {"action": "add", "prompt": "x", "max_tokens": 0}, [])
        assert "max_tokens must be" in view.widget.status["message"]  # refused in the widget, not raised
        view._on_message(view.widget, {"action": "run"}, [])
        assert not llm.paused and llm.engine.step_recorder is None  # Run costs the engine nothing
        for _ in range(200):
            if view.finished:
                break
            await asyncio.sleep(0.01)
        return rid, view

    rid, view = asyncio.run(main())
    assert [f["request_id"] for f in view.finished] == [rid] and view.finished[0]["reason"] == "length"


@gpu
def test_reports_under_asynchronous_scheduling_on_a_gpu(tiny_model_dir):
    """On a GPU a step launches its batch and finishes the previous one: the reports still account for
    every token the model computed, and each batch's block tables are the engine's."""
    with LLM(str(tiny_model_dir("llama")), device="cuda", num_kv_blocks=64, max_model_len=128, block_size=BS,
             async_scheduling=True) as llm:
        assert llm.engine.async_scheduling
        llm.engine.add_request("a", prompt(20), params(6))
        llm.engine.add_request("b", prompt(9, first=40), params(6))
        reports = []
        while llm.engine.has_unfinished_requests():
            reports.append(llm.debug_step())
            for rid, ids in reports[-1].block_tables.items():
                if rid in llm.engine.scheduler.requests:  # (not one that ended in this step)
                    assert list(ids) == llm.engine.kv_cache_manager.block_ids(rid)
        assert sum(r.num_batched_tokens for r in reports) == llm.stats()["computed_tokens"]
        assert sorted(rid for r in reports for rid, _ in r.finished) == ["a", "b"]
        assert sum(r.blocks_allocated + r.blocks_hit for r in reports) == sum(r.blocks_freed for r in reports)


def test_steps_are_numbered_by_the_batch_they_schedule_under_asynchronous_scheduling(make_llm):
    """With a step in flight, the next one schedules batch N + 2 while stats()["steps"] (finished steps)
    says N: each debug_step (a recorder of its own) must still number its batch N + 2, not repeat N + 1."""
    llm = make_llm(async_scheduling=True)
    llm.engine.add_request("a", prompt(5), params(4))
    reports = []
    while llm.engine.has_unfinished_requests():
        reports.append(llm.debug_step())
    assert [r.step for r in reports] == list(range(1, len(reports) + 1))
    assert llm.stats()["steps"] == len(reports) - 1  # the last call only finished the step in flight
