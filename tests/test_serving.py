"""The OpenAI-compatible server (pagednb/serving/) against the official `openai` client, on loopback, with
the embedded model: answers equal to llm.generate's at temperature 0 whether streamed or not, usage, n,
stop strings, errors in OpenAI's shape, a disconnect that frees the request's blocks, 64 concurrent
streams, /metrics, a cell's synchronous generate while the server streams, and `pagednb serve`."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import openai
import pytest
from jupyter_client.manager import start_new_kernel
from prometheus_client.parser import text_string_to_metric_families

from pagednb import LLM, SamplingParams
from pagednb.chat_template import apply_chat_template
from pagednb.serving import app as serving_app

from kernel_support import run_cell

pytestmark = pytest.mark.usefixtures("pool_checked_after_each_test")

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a story about a cat named Tom."}]
GREEDY = dict(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def llm():
    llm = LLM()
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(llm):
    """Started with no running loop: the server runs on a loop of its own in a thread (the script case)."""
    server = llm.serve(port=0)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def generated(llm, prompt, **params) -> list[str]:
    return [c.text for c in llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs]


def chat_prompt(llm, messages) -> dict:
    return {"prompt_token_ids": apply_chat_template(llm.get_tokenizer(), messages)}


def joined(chunks, chat: bool) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
    return texts


# ---- answers ---------------------------------------------------------------------------------------
def test_completion_streamed_and_not_equal_generate_with_right_usage(llm, server, client):
    expected = generated(llm, PROMPT, **GREEDY)[0]
    whole = client.completions.create(model=server.model_name, prompt=PROMPT, **GREEDY)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    num_prompt = len(llm.get_tokenizer()(PROMPT)["input_ids"])
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == \
        (num_prompt, 24, num_prompt + 24)
    chunks = list(client.completions.create(model=server.model_name, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert joined(chunks, chat=False) == {0: expected}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_streamed_and_not_equal_llm_chat(llm, server, client):
    expected = llm.chat(CHAT, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text
    whole = client.chat.completions.create(model=server.model_name, messages=CHAT, **GREEDY)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(chat_prompt(llm, CHAT)["prompt_token_ids"])
    chunks = list(client.chat.completions.create(model=server.model_name, messages=CHAT, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert joined(chunks, chat=True) == {0: expected}
    assert all(chunk.usage is None for chunk in chunks)  # no include_usage: no usage chunk
    # max_completion_tokens is OpenAI's newer name for max_tokens, and wins over it
    short = client.chat.completions.create(model=server.model_name, messages=CHAT, temperature=0, max_tokens=24,
                                           max_completion_tokens=5)
    assert short.usage.completion_tokens == 5 and expected.startswith(short.choices[0].message.content)


def test_n_seed_and_stop_strings_as_in_python(llm, server, client):
    params = dict(n=2, temperature=1.0, seed=7, max_tokens=16)
    expected = generated(llm, PROMPT, **params)
    whole = client.completions.create(model=server.model_name, prompt=PROMPT, **params)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == expected
    assert whole.usage.completion_tokens == 32
    chunks = client.completions.create(model=server.model_name, prompt=PROMPT, stream=True, **params)
    assert joined(chunks, chat=False) == dict(enumerate(expected))
    free_text = generated(llm, PROMPT, temperature=0, max_tokens=40)[0]
    stop = free_text.split()[3]  # a word the greedy answer reaches
    stopped = client.completions.create(model=server.model_name, prompt=PROMPT, temperature=0, max_tokens=40,
                                        stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert stopped.choices[0].text == generated(llm, PROMPT, temperature=0, max_tokens=40, stop=[stop])[0]


def test_logprobs_in_both_shapes(llm, server, client):
    expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=2), use_tqdm=False)[0]
    chosen = [pos[t].logprob for t, pos in zip(expected.outputs[0].token_ids, expected.outputs[0].logprobs)]
    legacy = client.completions.create(model=server.model_name, prompt=PROMPT, temperature=0, max_tokens=4,
                                       logprobs=2).choices[0].logprobs
    assert legacy.token_logprobs == pytest.approx(chosen) and all(len(top) == 2 for top in legacy.top_logprobs)
    assert "".join(legacy.tokens) == expected.outputs[0].text
    chat = client.chat.completions.create(model=server.model_name, messages=CHAT, temperature=0, max_tokens=4,
                                          logprobs=True, top_logprobs=3).choices[0].logprobs.content
    assert len(chat) == 4 and all(len(p.top_logprobs) == 3 and p.top_logprobs[0].logprob >= p.logprob for p in chat)


def test_streamed_logprobs_cover_every_token_once(llm, server, client):
    """A chunk may carry the tokens of several steps (the server sends at most one chunk per stream
    interval): their logprobs come along, each token's once, in order."""
    whole = client.completions.create(model=server.model_name, prompt=PROMPT, temperature=0, max_tokens=20,
                                      logprobs=1).choices[0]
    tokens, token_logprobs = [], []
    for chunk in client.completions.create(model=server.model_name, prompt=PROMPT, temperature=0, max_tokens=20,
                                           logprobs=1, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            token_logprobs += chunk.choices[0].logprobs.token_logprobs
    assert tokens == whole.logprobs.tokens and len(tokens) == 20
    assert token_logprobs == pytest.approx(whole.logprobs.token_logprobs)


def test_response_format_json_schema_constrains_the_answer(server, client):
    schema = {"type": "string", "enum": ["yes", "no"]}
    answer = client.chat.completions.create(
        model=server.model_name, messages=CHAT, max_tokens=10, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert json.loads(answer.choices[0].message.content) in ("yes", "no")


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [server.model_name]
    assert httpx.get(server.url.removesuffix("/v1") + "/health").status_code == 200


# ---- errors ----------------------------------------------------------------------------------------
def test_bad_requests_get_openai_errors_naming_the_field_and_others_carry_on(llm, server, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=server.model_name, prompt=PROMPT, top_p=2)
    with pytest.raises(ValueError) as python:
        SamplingParams(top_p=2)
    assert bad.value.body["message"] == str(python.value) and bad.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=server.model_name, prompt=[5] * (llm.max_model_len + 1))
    assert "max_model_len" in too_long.value.body["message"] and too_long.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=server.model_name, prompt=PROMPT, echo=True)
    with pytest.raises(openai.BadRequestError, match="messages\\[0\\]"):
        client.chat.completions.create(model=server.model_name, messages=[{"content": "no role"}])
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert unknown.value.body["param"] == "model"
    malformed = httpx.post(server.url + "/completions", content=b"{not json",
                           headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and set(malformed.json()["error"]) == {"message", "type", "param", "code"}
    assert client.completions.create(model=server.model_name, prompt=PROMPT, **GREEDY).choices[0].text == \
        generated(llm, PROMPT, **GREEDY)[0]


def test_api_key_is_required_when_set(llm):
    server = llm.serve(port=0, api_key="s3cret")
    try:
        no_key = httpx.get(server.url + "/models")
        assert no_key.status_code == 401 and no_key.json()["error"]["code"] == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=server.url, api_key="s3cret", max_retries=0)
        answer = good.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=2)
        assert answer.usage.completion_tokens == 2
        assert httpx.get(server.url.removesuffix("/v1") + "/health").status_code == 200  # open, as in vLLM
    finally:
        server.stop()


def test_binding_beyond_loopback_without_a_key_warns(llm, caplog):
    server = llm.serve(host="0.0.0.0", port=0)
    server.stop()
    assert any("without an api_key" in r.message for r in caplog.records)


# ---- metrics ---------------------------------------------------------------------------------------
def scrape(server) -> dict[str, float]:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.labels.get("finished_reason", "length") == "length"}


def test_metrics_parse_and_move(server, client):
    before = scrape(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert name in before
    out = client.completions.create(model=server.model_name, prompt=PROMPT, **GREEDY)
    after = scrape(server)
    assert after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0) == 24
    assert after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == out.usage.prompt_tokens
    assert after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0) == 1
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert after[f"vllm:{histogram}_count"] - before.get(f"vllm:{histogram}_count", 0) == 1
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]


# ---- the server on a running loop (a notebook kernel's case) ---------------------------------------
def test_disconnect_mid_stream_frees_the_blocks_within_a_step(llm, monkeypatch):
    """The server learns of the close on the loop's next turns (each also runs one engine step), aborts
    the request, and the step after that gives its blocks back."""
    aborted_at = []
    real_abort = llm.driver.abort
    monkeypatch.setattr(llm.driver, "abort", lambda ids: (aborted_at.append(llm.driver.num_steps), real_abort(ids)))

    async def main():
        server = llm.serve(port=0)
        body = {"model": server.model_name, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient() as http:
            async with http.stream("POST", server.url + "/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    if llm.driver.num_steps > 5:
                        break
                assert llm.driver.consumer_ids(), "the request still runs when the client leaves"
            closed_at = llm.driver.num_steps
        while llm.stats()["used_blocks"]:
            await asyncio.sleep(0)
        freed_at = llm.driver.num_steps
        server.stop()
        await server.wait_stopped()
        return closed_at, freed_at
    closed_at, freed_at = asyncio.run(asyncio.wait_for(main(), 60))
    assert aborted_at and aborted_at[0] - closed_at <= 3, (closed_at, aborted_at)
    assert freed_at - aborted_at[0] <= 1 and freed_at - closed_at < 10


def test_paced_chunks_carry_every_token_and_the_engine_builds_no_output_in_between(llm, server, client,
                                                                                  monkeypatch):
    """With a pace longer than the request, the engine builds two outputs (the first tokens, then the
    final one with all the rest, sent as soon as the request ends), not one per step; the text is whole."""
    expected = generated(llm, PROMPT, temperature=0, max_tokens=40, ignore_eos=True)[0]
    monkeypatch.setattr(serving_app, "STREAM_INTERVAL_S", 3600.0)
    built = []
    real_step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: [built.append(o) or o for o in real_step()])
    start = time.monotonic()
    chunks = list(client.completions.create(model=server.model_name, prompt=PROMPT, temperature=0, max_tokens=40,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert time.monotonic() - start < 60  # the final chunk did not wait for the pace
    assert joined(chunks, chat=False) == {0: expected} and chunks[-1].usage.completion_tokens == 40
    assert [len(o.outputs[0].token_ids) for o in built] == [1, 39] and len(chunks) == 3  # + the usage chunk


def test_a_non_streaming_client_that_leaves_aborts_its_request(llm, server):
    body = {"model": server.model_name, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    left_at = llm.driver.num_steps
    deadline = time.monotonic() + 30
    while llm.stats()["used_blocks"] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert llm.stats()["used_blocks"] == 0 and llm.driver.num_steps - left_at < 50  # not the 400 steps to the end


def test_64_concurrent_streams_lose_nothing_and_equal_their_solo_runs(llm):
    prompts = [f"{['Once upon a time', 'The dog', 'A little cat', 'Max said'][i % 4]} {i}" for i in range(64)]
    solo = [generated(llm, p, temperature=0, max_tokens=12, ignore_eos=True)[0] for p in prompts]

    async def main():
        server = llm.serve(port=0)
        client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)

        async def one(prompt):
            stream = await client.completions.create(model=server.model_name, prompt=prompt, temperature=0,
                                                     max_tokens=12, stream=True, extra_body={"ignore_eos": True})
            return joined([chunk async for chunk in stream], chat=False)[0]
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()
            server.stop()
            await server.wait_stopped()
    start = time.perf_counter()
    assert asyncio.run(asyncio.wait_for(main(), 90)) == solo and all(solo)
    assert time.perf_counter() - start < 90


def test_a_cells_synchronous_generate_steps_the_servers_requests_too(llm):
    """generate blocks the loop (as a cell does): the server's streams advance meanwhile and end after."""
    prompts = ["The dog", "A little cat", "Max said"]
    solo = [generated(llm, p, temperature=0, max_tokens=8, ignore_eos=True)[0] for p in prompts]

    async def main():
        server = llm.serve(port=0)
        client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        started = asyncio.Event()

        async def one(prompt):
            stream = await client.completions.create(model=server.model_name, prompt=prompt, temperature=0,
                                                     max_tokens=8, stream=True, extra_body={"ignore_eos": True})
            chunks = []
            async for chunk in stream:
                chunks.append(chunk)
                started.set()
            return joined(chunks, chat=False)[0]
        tasks = [asyncio.ensure_future(one(p)) for p in prompts]
        await started.wait()
        served = [r for r in llm.driver.consumer_ids() if r.startswith("cmpl-")]
        ours = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        left = [r for r in llm.driver.consumer_ids() if r in served]
        texts = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await client.close()
        server.stop()
        await server.wait_stopped()
        return served, left, ours, texts
    served, left, ours, texts = asyncio.run(main())
    assert served and not left, "the server's requests finished during the cell's generate"
    assert texts == solo and all(texts) and len(ours[0].outputs[0].token_ids) == 40


def test_close_stops_the_server(tmp_path):
    own = LLM(num_kv_blocks=64)
    server = own.serve(port=0)
    assert httpx.get(server.url.removesuffix("/v1") + "/health").status_code == 200
    own.close()
    assert not server.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url.removesuffix("/v1") + "/health")


# ---- the command line ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pagednb_serve_command(llm):
    port = free_port()
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, "-m", "pagednb", "serve", "--port", str(port), "--api-key", "k",
                                "--served-model-name", "tiny", "--max-model-len", "256"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=60)
        expected = generated(llm, PROMPT, **GREEDY)[0]
        assert client.completions.create(model="tiny", prompt=PROMPT, **GREEDY).choices[0].text == expected
        chunks = client.completions.create(model="tiny", prompt=PROMPT, stream=True, **GREEDY)
        assert joined(chunks, chat=False) == {0: expected}
        with pytest.raises(openai.BadRequestError, match="max_model_len"):
            client.completions.create(model="tiny", prompt=[5] * 300)
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0  # Ctrl-C is how a terminal server stops: a clean exit


# ---- inside a real Jupyter kernel ------------------------------------------------------------------
def test_in_a_kernel_the_server_and_a_cells_stream_share_the_engine():
    """Cell 1 serves; cell 2 sends a request with AsyncOpenAI and returns; cell 3 streams with llm.stream
    while that request is in flight on the same engine (same loop); both answers are the solo ones."""
    manager, kernel = start_new_kernel(kernel_name="python3", env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        run_cell(kernel, textwrap.dedent("""
            import asyncio, openai
            from pagednb import LLM, SamplingParams
            STORY = "Once upon a time, there was a dog named Max."
            llm = LLM()
            server = llm.serve(port=0)
            print(server.url)
        """))
        run_cell(kernel, textwrap.dedent("""
            client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
            async def ask():
                reply = await client.chat.completions.create(
                    model=server.model_name, messages=[{"role": "user", "content": "Tell me a story."}],
                    temperature=0, max_tokens=60, extra_body={"ignore_eos": True})
                return reply.choices[0].message.content
            http_task = asyncio.ensure_future(ask())
        """))
        run_cell(kernel, textwrap.dedent("""
            while not llm.driver.consumer_ids():   # the request has reached the engine
                await asyncio.sleep(0.01)
            pieces, overlapped = [], False
            async for out in llm.stream(STORY, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)):
                pieces.append(out.outputs[0].delta)
                overlapped |= any(r.startswith("chatcmpl-") for r in llm.driver.consumer_ids())
        """))
        result = run_cell(kernel, textwrap.dedent("""
            answer = await asyncio.wait_for(http_task, 60)
            solo_chat = llm.chat([{"role": "user", "content": "Tell me a story."}],
                                 SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
            solo_stream = llm.generate(STORY, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                                       use_tqdm=False)
            print(overlapped, answer == solo_chat[0].outputs[0].text != "",
                  "".join(pieces) == solo_stream[0].outputs[0].text != "")
            llm.close()
        """))
        assert result.split() == ["True", "True", "True"], result
        assert run_cell(kernel, "await server.wait_stopped(); print(server.running)").strip() == "False"
    finally:
        kernel.stop_channels()
        manager.shutdown_kernel(now=True)
