"""The notebook views (pagednb.notebook) in-process on the CPU: ipywidgets works without a frontend, and
every message a widget would send to the browser is counted by patching `Widget._send`."""
import asyncio
import html
import re
import threading
import time

import ipywidgets as widgets
import numpy as np
import pytest
import torch

from pagednb import LLM, SamplingParams
from pagednb.notebook import ChatView, PoolView, StreamView, chat, pool_view, stream
from pagednb.notebook.block_map import MAX_CELLS, BlockMapRenderer, aggregate, request_colour
from pagednb.notebook.markdown import markdown_to_html, plain_to_html
from pagednb.notebook.throttle import MessageBudget, Throttle, max_in_window
from pagednb.notebook.token_view import DEFAULT_TOP_K, TokenView, token_row

MESSAGES = [{"role": "user", "content": "Tell me a story about a dog named Max."}]
LONG = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Quick steps even on a shared 2-core CPU (two OpenMP threads fighting other processes crawl), so
    the streams really are faster than the text throttle."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm():
    with LLM(num_kv_blocks=256) as model:
        yield model


@pytest.fixture
def sent(monkeypatch):
    """Every widget message as (time, widget, state), in order."""
    log = []
    real_send = widgets.Widget._send

    def send(self, msg, buffers=None):
        log.append((time.monotonic(), self, msg.get("state", {})))
        return real_send(self, msg, buffers)
    # The measuring instrument, not a shortcut: every message to the browser goes through `_send`.
    monkeypatch.setattr(widgets.Widget, "_send", send)
    return log


def text_updates(log, widget):
    return [(t, state["value"]) for t, w, state in log if w is widget and "value" in state]


async def until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


# ---- stream() ---------------------------------------------------------------------------------------
def test_stream_text_grows_to_the_final_output_and_the_status_says_how_it_ended(llm, sent):
    async def main():
        view = stream(llm, MESSAGES, SamplingParams(max_tokens=120, temperature=0), markdown=False, display=False)
        assert isinstance(view, StreamView) and not view.done
        out = await view
        return view, out
    view, out = asyncio.run(main())
    assert view.done and view.result().result() is out
    text = out.outputs[0].text
    assert len(text) > 50
    updates = [html.unescape(v) for _, v in text_updates(sent, view.text)]
    assert len(updates) >= 3
    assert all(len(a) <= len(b) for a, b in zip(updates, updates[1:])), "text only grows"
    assert view.text.value == plain_to_html(text)  # the final flush landed
    status = view.status.value
    assert re.search(r"\d+(\.\d+)? tok/s", status) and f"{len(out.outputs[0].token_ids)} tokens" in status
    assert status.endswith(out.outputs[0].finish_reason) and "TTFT" in status
    assert view.cancel_button.disabled


def test_stream_renders_markdown_safely(llm):
    async def main():
        return await stream(llm, MESSAGES, SamplingParams(max_tokens=30, temperature=0), display=False)
    # the rendering itself, on hostile input
    rendered = markdown_to_html('**bold** <script>alert(1)</script> `a<b`\n\n- item\n```\nx < y')
    assert "<script>" not in rendered and "&lt;script&gt;" in rendered
    assert "<strong>bold</strong>" in rendered and "<code>a&lt;b</code>" in rendered
    assert "<li>item</li>" in rendered and "<pre><code>x &lt; y</code></pre>" in rendered
    assert 'href="javascript' not in markdown_to_html("[x](javascript:alert(1))")
    assert '"' not in markdown_to_html('[x](https://e.com/"onmouseover=1)').split('href="')[1].split('"')[0]
    out = asyncio.run(main())
    assert out.outputs[0].text


@pytest.mark.parametrize("from_thread", [False, True])
def test_cancel_button_aborts_the_request_in_the_engine(llm, from_thread):
    async def main():
        view = stream(llm, MESSAGES, LONG, display=False)
        await until(lambda: view.latest is not None and len(view.latest.outputs[0].token_ids) >= 5)
        assert llm.stats()["used_blocks"] > 0
        if from_thread:  # ipykernel 7.0-7.3 may run button handlers on another thread
            clicker = threading.Thread(target=view.cancel_button.click)
            clicker.start()
            clicker.join()
        else:
            view.cancel_button.click()
        out = await view
        return view, out, llm.stats()
    view, out, stats = asyncio.run(main())
    assert out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) < 400
    assert stats["used_blocks"] == 0 and stats["running"] == 0
    assert view.status.value.endswith("abort")


def test_cancel_method_and_await_after_the_end(llm):
    async def main():
        view = stream(llm, MESSAGES, LONG, display=False)
        await asyncio.sleep(0)
        view.cancel()
        out = await view
        view.cancel()  # after the end: a no-op
        return out, await view.result()
    out, again = asyncio.run(main())
    assert out is again and out.outputs[0].finish_reason == "abort"


def test_stream_needs_a_running_loop_and_checks_the_prompt_first(llm):
    with pytest.raises(RuntimeError, match="event loop"):
        stream(llm, "hello", display=False)

    async def main():
        with pytest.raises(ValueError):
            stream(llm, "hello", SamplingParams(max_tokens=10_000, temperature=-1), display=False)
    asyncio.run(main())


# ---- chat() -----------------------------------------------------------------------------------------
def test_chat_two_turns_reuse_the_prefix_cache(llm):
    params = SamplingParams(max_tokens=60, temperature=0)

    async def main():
        view = chat(llm, "You are a storyteller who tells short animal stories.", params, display=False)
        assert isinstance(view, ChatView)
        first = view.send("Tell me a story about a dog named Max.")
        with pytest.raises(RuntimeError, match="still streaming"):
            view.send("too early")
        out1 = await first
        hits_before = llm.stats()["prefix_cache_hit_tokens"]
        second = view.send("Tell me another one.")
        out2 = await second
        return view, first, second, out1, out2, hits_before

    view, first, second, out1, out2, hits_before = asyncio.run(main())
    tokenizer = llm.get_tokenizer()
    conversation = view.history[:4]
    assert [m["role"] for m in view.history] == ["system", "user", "assistant", "user", "assistant"]
    assert view.history[2]["content"] == out1.outputs[0].text
    expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert out2.prompt_token_ids == expected  # the template over the whole history
    assert out2.num_cached_tokens > 0 and llm.stats()["prefix_cache_hit_tokens"] > hits_before
    # history as bubbles: system, user, assistant, user, assistant
    assert len(view.history_box.children) == 5
    assert first.widget in view.history_box.children and second.widget in view.history_box.children
    assert "Tell me another one." in view.history_box.children[3].value
    for turn, out in ((first, out1), (second, out2)):
        assert "TTFT" in turn.status.value and turn.status.value.endswith(out.outputs[0].finish_reason)
    assert "prefix cache" in second.status.value
    assert not view.send_button.disabled and view.cancel_button.disabled


def test_chat_send_and_cancel_buttons_work_from_another_thread(llm):
    async def main():
        view = chat(llm, sampling_params=LONG, display=False)
        view.input.value = "Tell me a story about a cat named Tom."
        threading.Thread(target=view.send_button.click).start()
        await until(lambda: view.turn is not None and view.turn.latest is not None)
        assert view.input.value == "" and view.send_button.disabled
        threading.Thread(target=view.cancel_button.click).start()
        out = await view.turn
        return view, out, llm.stats()
    view, out, stats = asyncio.run(main())
    assert out.outputs[0].finish_reason == "abort" and stats["used_blocks"] == 0
    assert view.history[-1] == {"role": "assistant", "content": out.outputs[0].text}


def test_enter_in_the_chat_input_sends_like_the_send_button(llm):
    async def main():
        view = chat(llm, sampling_params=SamplingParams(max_tokens=20, temperature=0), display=False)
        view.input.value = "What sound does a cat make?"
        # what the browser sends on Enter (after the typed value), handled as ipywidgets does, from
        # another thread as ipykernel 7.0-7.3 may
        submit = threading.Thread(target=view.input._handle_custom_msg, args=({"event": "submit"}, []))
        submit.start()
        submit.join()
        await until(lambda: view.turn is not None)
        out = await view.turn
        return view, out
    view, out = asyncio.run(main())
    assert view.input.value == "" and out.outputs[0].text
    assert view.history == [{"role": "user", "content": "What sound does a cat make?"},
                            {"role": "assistant", "content": out.outputs[0].text}]


def test_the_chat_history_follows_new_messages_in_the_browser(llm):
    async def main():
        return chat(llm, display=False)
    view = asyncio.run(main())
    follow = [w for w in view.widget.children if type(w).__name__ == "AutoScroll"]
    assert len(follow) == 1 and "pagednb-chat-history" in view.history_box._dom_classes
    assert "pagednb-chat" in view.widget._dom_classes  # the container the browser side looks in
    assert (follow[0].container, follow[0].target) == ("pagednb-chat", "pagednb-chat-history")
    assert "MutationObserver" in follow[0]._esm


# ---- the token view ---------------------------------------------------------------------------------
def test_token_rows_carry_each_token_its_probability_and_the_alternatives_by_rank(llm):
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=3), use_tqdm=False)[0]
    completion = out.outputs[0]
    rows = [token_row(t, position) for t, position in zip(completion.token_ids, completion.logprobs)]
    assert len(rows) == len(completion.token_ids)
    assert "".join(r[0] for r in rows) == completion.text
    for token_id, position, (text, p, rank, alternatives) in zip(completion.token_ids, completion.logprobs, rows):
        chosen = position[token_id]
        assert p == pytest.approx(np.exp(chosen.logprob), abs=1e-5) and rank == chosen.rank
        assert [a[2] for a in alternatives] == sorted(lp.rank for lp in position.values())
        assert len([a for a in alternatives if a[2] <= 3]) == 3
        assert all(0 <= a[1] <= 1 for a in alternatives)
        assert alternatives[0][1] >= alternatives[-1][1]
    assert token_row(5, {5: type(chosen)(float("-inf"), 9, None)})[:3] == ["<5>", 0.0, 9]


def test_the_token_view_sends_only_the_new_tokens_and_all_of_them_when_a_browser_asks(llm, monkeypatch):
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=12, temperature=0, logprobs=2), use_tqdm=False)[0]
    completion = out.outputs[0]
    view = TokenView()
    messages = []
    monkeypatch.setattr(view, "send", lambda content, buffers=None: messages.append(content))
    partial = type(completion)(0, "", completion.token_ids[:5], logprobs=completion.logprobs[:5])
    view.update(partial)
    view.update(partial)  # nothing new: nothing sent
    view.update(completion)
    expected = [token_row(t, p) for t, p in zip(completion.token_ids, completion.logprobs)]
    assert messages == [{"start": 0, "rows": expected[:5]}, {"start": 5, "rows": expected[5:]}]
    view._handle_custom_msg({"want": "all"}, [])  # a view drawn later
    assert messages[-1] == {"start": 0, "rows": expected} and view.rows == expected


def scored_rows(llm, out):
    """The token rows of a reply scored independently: prompt + reply prefilled with prompt_logprobs."""
    prompt, reply = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
    scored = llm.generate({"prompt_token_ids": prompt + reply},
                          SamplingParams(max_tokens=1, prompt_logprobs=DEFAULT_TOP_K), use_tqdm=False)[0]
    return [token_row(t, p) for t, p in zip(reply, scored.prompt_logprobs[len(prompt):])]


def test_the_token_toggle_scores_a_finished_reply_and_only_creates_the_widget_when_pressed(llm, sent):
    async def main():
        view = stream(llm, MESSAGES, SamplingParams(max_tokens=40, temperature=0), display=False)
        out = await view
        untouched = view.tokens
        view.token_button.value = True  # the click, as the browser syncs it
        await until(lambda: view.tokens is not None and len(view.tokens.rows) == len(out.outputs[0].token_ids))
        shown = (view.tokens.layout.display, view.text.layout.display)
        view.token_button.value = False
        await until(lambda: view.text.layout.display is None)
        return view, out, untouched, shown
    view, out, untouched, shown = asyncio.run(main())
    assert untouched is None  # no token widget, and no token messages, until the toggle is pressed
    assert out.outputs[0].logprobs is None  # the engine computed no logprobs for a view nobody toggled
    assert isinstance(view.tokens, TokenView) and view.tokens in view.widget.children
    assert view.tokens.rows == scored_rows(llm, out)
    # the scored numbers are the ones logprobs= gives while generating (same tokens: greedy)
    direct = llm.chat(MESSAGES, SamplingParams(max_tokens=40, temperature=0, logprobs=DEFAULT_TOP_K),
                      use_tqdm=False)[0].outputs[0]
    assert direct.token_ids == out.outputs[0].token_ids
    for (text, p, rank, _), token_id, position in zip(view.tokens.rows, direct.token_ids, direct.logprobs):
        assert p == pytest.approx(np.exp(position[token_id].logprob), abs=1e-4) and rank == position[token_id].rank
    assert shown == (None, "none")
    assert view.tokens.layout.display == "none"
    assert "mouseover" in view.tokens._esm  # the hover that shows the alternatives


def test_a_toggle_pressed_while_the_reply_streams_scores_it_again_when_it_ends(llm):
    async def main():
        view = stream(llm, MESSAGES, SamplingParams(max_tokens=60, ignore_eos=True, temperature=0), display=False)
        await until(lambda: view.latest is not None and len(view.latest.outputs[0].token_ids) >= 3)
        view.token_button.value = True
        out = await view
        await until(lambda: view.tokens is not None and len(view.tokens.rows) == 60)
        return view, out
    view, out = asyncio.run(main())
    assert view.tokens.rows == scored_rows(llm, out)


def test_a_scoring_that_fails_is_logged_once_and_not_retried(llm, monkeypatch, caplog):
    calls = []

    async def refuse(prompt, params, **_):
        calls.append(params)
        raise RuntimeError("the engine is closed")

    async def main():
        view = stream(llm, MESSAGES, SamplingParams(max_tokens=10, temperature=0), display=False)
        await view
        monkeypatch.setattr(llm, "agenerate", refuse)
        view.token_button.value = True
        await until(lambda: view.tokens is not None and calls and view._scoring is None)
        await asyncio.sleep(0.05)
        return view
    with caplog.at_level("WARNING", logger="pagednb"):
        view = asyncio.run(main())
    assert len(calls) == 1 and calls[0].prompt_logprobs == DEFAULT_TOP_K
    assert view.tokens.rows == [] and "scoring the tokens failed" in caplog.text


def test_a_view_opened_with_the_token_view_draws_the_engines_logprobs_live(llm):
    async def main():
        view = stream(llm, MESSAGES, SamplingParams(max_tokens=20, temperature=0), token_view=True, display=False)
        assert view.tokens is not None and view.token_button.value  # open before the first token
        out = await view
        await until(lambda: len(view.tokens.rows) == len(out.outputs[0].token_ids))
        return view, out
    view, out = asyncio.run(main())
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs[0]) >= DEFAULT_TOP_K
    assert view.tokens.rows == [token_row(t, p) for t, p in zip(completion.token_ids, completion.logprobs)]
    assert view.text.layout.display == "none"


def test_a_chat_reply_after_one_shown_as_tokens_streams_its_tokens_live(llm):
    async def main():
        view = chat(llm, sampling_params=SamplingParams(max_tokens=8, temperature=0), display=False)
        first = view.send("Tell me a story about a dog named Max.")
        await first
        second_plain = view.send("Another one.")
        await second_plain
        second_plain.token_button.value = True  # the reader looks at this reply's tokens...
        await until(lambda: second_plain.tokens is not None and second_plain.tokens.rows)
        third = view.send("And a third.")  # ...and keeps the token view on for the next
        return await first, third, await third
    first, third, out = asyncio.run(main())
    assert first.outputs[0].logprobs is None
    assert third.tokens is not None and third.token_button.value and out.outputs[0].logprobs is not None


def test_a_caller_asking_for_logprobs_gets_its_own_k(llm):
    async def main():
        return await stream(llm, MESSAGES, SamplingParams(max_tokens=5, temperature=0, logprobs=2), display=False)
    out = asyncio.run(main())
    assert all(len([lp for lp in position.values() if lp.rank <= 2]) == 2 for position in out.outputs[0].logprobs)


# ---- pool_view() ------------------------------------------------------------------------------------
def map_counts(html_value):
    grid = html_value.split('class="pagednb-grid">')[1].split("</div>")[0]
    return {"used": len(re.findall(r'<i class="(?:o\d+|u)"', grid)), "cached": grid.count('<i class="c">'),
            "free": grid.count("<i></i>")}


def test_pool_view_shows_the_pool(llm):
    async def main():
        view = pool_view(llm, display=False)
        assert isinstance(view, PoolView) and view.live
        a = stream(llm, MESSAGES, LONG, display=False)
        b = stream(llm, "Once upon a time", LONG, display=False)
        await until(lambda: a.latest is not None and b.latest is not None)
        view.refresh()
        stats, blocks = llm.stats(), llm.block_map()  # same moment: nothing steps in between
        snapshot = (view.used.value, view.activity.value, view.block_map.value, view.usage_bar.value)
        a.cancel(), b.cancel()
        await a, await b
        # the live task catches up on its own, within a few refresh intervals however slow the machine
        await until(lambda: view.used.value.startswith("used 0 "))
        live = view.used.value
        view.stop()
        await asyncio.sleep(0)
        return view, stats, blocks, snapshot, live, (a.request_id, b.request_id)

    view, stats, blocks, (used, activity, block_html, usage), live, ids = asyncio.run(main())
    assert stats["used_blocks"] > 0
    assert f"used {stats['used_blocks']} " in used
    assert f"free {stats['free_blocks']} ({stats['cached_blocks']} cached) of {stats['num_blocks']} blocks" in used
    assert usage == pytest.approx(stats["kv_usage"], abs=1e-4)
    assert f"running {stats['running']} " in activity and "tok/s" in activity and "prefix-cache hits" in activity
    counts = map_counts(block_html)
    assert counts == {s: sum(1 for state, _ in blocks if state == s) for s in ("used", "cached", "free")}
    for rid in ids:  # each running request has its own colour rule
        assert request_colour(rid) in block_html
    assert live.startswith("used 0 ")  # after the cancels, without an explicit refresh
    assert not view.live


def test_stopping_the_pool_view_draws_the_final_state(llm):
    """Run All of 01: the view's last refresh was mid-run when the cell right after the requests stops
    it; stop() must still leave it showing the idle engine."""
    async def main():
        view = pool_view(llm, refresh_hz=0.5, display=False)  # a refresh every 2 s: none lands in between
        a = stream(llm, MESSAGES, LONG, display=False)
        await until(lambda: a.latest is not None and len(a.latest.outputs[0].token_ids) >= 3)
        view.refresh()
        mid_run = view.used.value, view.activity.value
        a.cancel()
        await a
        view.stop()
        await asyncio.sleep(0)
        return view, mid_run
    view, (used_mid, activity_mid) = asyncio.run(main())
    assert not used_mid.startswith("used 0 ") and "running 1" in activity_mid
    assert view.used.value.startswith("used 0 ") and "running 0 · waiting 0" in view.activity.value
    assert map_counts(view.block_map.value)["used"] == 0 and not view.live


def test_the_refresh_that_sees_the_engine_go_idle_redraws_the_block_map(llm):
    async def main():
        view = pool_view(llm, refresh_hz=5, display=False)
        a = stream(llm, MESSAGES, LONG, display=False)
        await until(lambda: "running 1" in view.activity.value and map_counts(view.block_map.value)["used"] > 0)
        view._map_due = float("inf")  # as after a slow block map on a big pool: its next turn is far off
        a.cancel()
        await a
        await until(lambda: "running 0" in view.activity.value)
        drawn = view.block_map.value
        view.stop()
        return drawn
    assert map_counts(asyncio.run(main()))["used"] == 0


def test_the_block_map_legend_names_each_request_in_its_colour():
    blocks = [("used", "chat-1")] * 3 + [("used", "other")] * 2 + [("cached", None)] * 4 + [("free", None)] * 7
    page = BlockMapRenderer().render(blocks)
    legend = page.split('class="pagednb-legend"')[1]
    for rid in ("chat-1", "other"):
        assert f"background:{request_colour(rid)}" in legend and f"</span>request {rid}</span>" in legend
    assert "cached" in legend and "free" in legend
    many = BlockMapRenderer().render([("used", f"r{i}") for i in range(20)])
    assert "+12 more requests" in many and many.count("pagednb-legend-request") == 8
    assert "no request holds blocks" in BlockMapRenderer().render([("free", None)] * 4)


def test_pool_view_without_a_loop_is_a_snapshot(llm):
    view = pool_view(llm, display=False)
    assert not view.live and view.used.value.startswith("used ")
    view.stop()


def test_big_pools_are_drawn_with_a_bounded_number_of_cells():
    blocks = [("used", "r1")] * 3000 + [("cached", None)] * 1000 + [("free", None)] * 4192
    cells, group = aggregate(blocks)
    assert len(cells) <= MAX_CELLS and group == 4
    page = BlockMapRenderer().render(blocks)
    assert page.count("<i") == len(cells) + 0 and "each cell shows 4 blocks" in page
    assert len(page) < 120_000
    assert request_colour("r1") == request_colour("r1") != request_colour("r2")


# ---- update rates -----------------------------------------------------------------------------------
def test_text_updates_stay_under_30_per_second_and_the_last_one_lands(llm, sent):
    burst = 100

    async def main():
        start = time.monotonic()
        view = stream(llm, MESSAGES, SamplingParams(max_tokens=480, ignore_eos=True, temperature=0), display=False)
        await until(lambda: view.latest is not None)
        # A synchronous call on the loop's thread steps the engine for everyone while the loop waits, so the
        # view then takes `burst` outputs at once: faster than 30 Hz on any machine, it must throttle.
        steps_before = llm.driver.num_steps
        llm.generate("Once upon a time", SamplingParams(max_tokens=burst, ignore_eos=True), use_tqdm=False)
        queued = llm.driver.num_steps - steps_before
        out = await view
        return view, out, queued, time.monotonic() - start
    view, out, queued, elapsed = asyncio.run(main())
    updates = text_updates(sent, view.text)
    assert queued >= burst and len(out.outputs[0].token_ids) == 480, "the view had a burst of outputs to throttle"
    assert len(updates) <= 30 * elapsed + 2, (len(updates), elapsed)
    assert max_in_window([e[0] for e in updates], 1.0) <= 32
    assert updates[-1][1] == markdown_to_html(out.outputs[0].text)


def test_all_views_together_stay_under_200_messages_per_second(llm, sent):
    async def main():
        view = pool_view(llm, refresh_hz=5, display=False)
        views = [stream(llm, MESSAGES, SamplingParams(max_tokens=300, ignore_eos=True, temperature=0, seed=i),
                        display=False) for i in range(8)]
        start = len(sent)
        outs = [await v for v in views]
        view.stop()
        return views, outs, sent[start:]
    views, outs, log = asyncio.run(main())
    assert max_in_window([e[0] for e in log], 1.0) <= 200 + 3 * 8  # ~200/s, and the final flushes that may not wait
    for v, out in zip(views, outs):
        assert v.text.value == markdown_to_html(out.outputs[0].text)
        assert v.status.value.endswith("length")


def test_throttle_renders_the_latest_state_at_most_hz_times_and_flushes():
    async def main():
        seen = []
        throttle = Throttle(hz=20, budget=MessageBudget(rate=1000))
        start = time.monotonic()
        for i in range(200):
            throttle.request(lambda i=i: seen.append(i))
            await asyncio.sleep(0.0025)
        elapsed = time.monotonic() - start
        await asyncio.sleep(0.1)  # the trailing render lands without a further request
        trailing = list(seen)
        throttle.flush(lambda: seen.append("final"))
        return trailing, seen, elapsed
    trailing, seen, elapsed = asyncio.run(main())
    assert 5 <= len(trailing) <= 20 * elapsed + 2 and trailing == sorted(trailing)
    assert trailing[-1] == 199  # the latest state, not a stale one
    assert seen[-1] == "final"


# ---- in a real kernel -------------------------------------------------------------------------------
KERNEL_CELL = """
import torch
torch.set_num_threads(1)
from pagednb import LLM, SamplingParams
from pagednb.notebook import pool_view, stream
llm = LLM(num_kv_blocks=1024)
pool = pool_view(llm)
views = [stream(llm, [{"role": "user", "content": "Tell me a story about a dog named Max."}],
                SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.8, seed=i)) for i in range(8)]
outs = [await v for v in views]
pool.stop()
import hashlib
print("ids", *[v.text.model_id for v in views])
print("finals", *[hashlib.sha1(v.text.value.encode()).hexdigest() for v in views])
print("reasons", *[o.outputs[0].finish_reason for o in outs])
"""


@pytest.mark.slow
def test_in_a_kernel_the_views_send_at_most_about_200_messages_per_second():
    """The comm messages as they leave a real ipykernel on IOPub (what jupyter_server rate-limits)."""
    import datetime
    import hashlib
    import os

    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3", env={**os.environ, "HF_HUB_OFFLINE": "1"})
    messages, stdout = [], []

    def hook(msg):
        if msg["msg_type"] == "comm_msg" and msg["content"]["data"].get("method") == "update":
            messages.append(msg)
        elif msg["msg_type"] == "stream":
            stdout.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            stdout.append("\n".join(msg["content"]["traceback"]))
    try:
        reply = client.execute_interactive(KERNEL_CELL, timeout=300, output_hook=hook)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    text = "".join(stdout)
    assert reply["content"]["status"] == "ok", text
    assert "reasons " + " ".join(["length"] * 8) in text
    ids = text.split("ids ")[1].split("\n")[0].split()
    finals = text.split("finals ")[1].split("\n")[0].split()
    times = [datetime.datetime.fromisoformat(str(m["header"]["date"])).timestamp() for m in messages]
    sent = sorted(times)
    assert len(sent) > 100
    assert max_in_window(sent, 1.0) <= 200 + 3 * 8
    for model_id, final in zip(ids, finals):  # each stream's final text went out on IOPub
        updates = [m for m in messages if m["content"]["comm_id"] == model_id and "value" in m["content"]["data"]["state"]]
        assert hashlib.sha1(updates[-1]["content"]["data"]["state"]["value"].encode()).hexdigest() == final
        per_second = len(updates) / (max(times) - min(times))
        assert per_second <= 31


def test_chat_turns_shrink_max_tokens_to_the_room_left_in_max_model_len():
    from pagednb.notebook import chat
    llm = LLM(num_kv_blocks=64, max_model_len=64)
    try:
        async def main():
            view = chat(llm, sampling_params=SamplingParams(temperature=0, max_tokens=400), display=False)
            out = await view.send("Tell me a story about a cat named Tom.")
            return out
        out = asyncio.run(main())
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) <= 64
        assert out.outputs[0].finish_reason in ("stop", "length")
    finally:
        llm.close()


# ---- failing soft -----------------------------------------------------------------------------------
def renderer_failing_after(calls: int):
    """A Markdown renderer that works `calls` times, then raises: a renderer bug hit mid-stream."""
    seen = []

    def render(text):
        seen.append(text)
        if len(seen) > calls:
            raise IndexError("renderer bug")
        return markdown_to_html(text)
    return render, seen


@pytest.mark.parametrize("good_calls", [0, 2])
def test_a_rendering_error_falls_back_to_plain_text_and_the_view_still_finishes(llm, monkeypatch, caplog, good_calls):
    render, seen = renderer_failing_after(good_calls)
    monkeypatch.setattr("pagednb.notebook.stream_view.markdown_to_html", render)

    async def main():
        view = stream(llm, MESSAGES, SamplingParams(max_tokens=60, ignore_eos=True, temperature=0), display=False)
        return view, await asyncio.wait_for(view.result(), timeout=120)  # hangs for good if the view died
    view, out = asyncio.run(main())
    text = out.outputs[0].text
    assert len(out.outputs[0].token_ids) == 60 and text
    assert len(seen) > good_calls, "the failing renderer was really used"
    assert view.done and view.cancel_button.disabled
    assert view.text.value == plain_to_html(text)  # the final text landed, as plain escaped text
    assert view.status.value.endswith("length")
    failures = [r for r in caplog.records if "rendering the text failed" in r.getMessage()]
    assert len(failures) == 1  # logged once, not at every render


def test_a_chat_reply_whose_rendering_fails_ends_and_the_chat_takes_the_next_message(llm, monkeypatch):
    render, _ = renderer_failing_after(0)
    monkeypatch.setattr("pagednb.notebook.stream_view.markdown_to_html", render)
    params = SamplingParams(max_tokens=20, temperature=0)

    async def main():
        view = chat(llm, sampling_params=params, display=False)
        first = await asyncio.wait_for(view.send("Tell me a story about a dog named Max.").result(), timeout=120)
        idle = (view.busy, view.send_button.disabled, view.cancel_button.disabled)
        second = await asyncio.wait_for(view.send("And another one.").result(), timeout=120)
        return view, first, second, idle
    view, first, second, idle = asyncio.run(main())
    assert idle == (False, False, True)  # after the first reply: not busy, Send on, Cancel off
    assert [m["role"] for m in view.history] == ["user", "assistant", "user", "assistant"]
    assert view.history[1]["content"] == first.outputs[0].text and view.history[3]["content"] == second.outputs[0].text
    assert view.turn.text.value.endswith(plain_to_html(second.outputs[0].text) + "</div>")
    assert not view.busy and not view.send_button.disabled and view.cancel_button.disabled


def test_an_odd_number_of_backticks_mid_stream_renders():
    """The renderer's own fuzz tests are in test_markdown.py; this is the case that broke streams."""
    assert markdown_to_html("Use `pri") == "<p>Use `pri</p>"
