"""What the notebook views cost the engine: N concurrent streams of the embedded model, consumed bare
(`async for out in llm.stream(...)`) vs shown in live stream views plus a pool view, and the widget
messages per second the views send. The views have their token view open (the "Token probabilities"
toggle pressed, so each text update redraws the tokens instead, coloured by probability, with the top-5
alternatives the views ask the engine for); `--no-token-view` measures them with the text shown.

The views ask the engine for those logprobs whether or not the token view is open (so that the toggle
works on any reply, finished ones too), so the bare consumers ask for the same: the slowdown measures
the views. What the logprobs cost the engine is measured apart, by a third variant, bare consumers
without logprobs (on the tiny CPU model a step is so cheap that the top-5 logprobs are a visible part).

No browser is attached, so every widget message goes through a comm that does what ipykernel does
with it on the kernel's side (JSON-encode the content, sign it with HMAC-SHA256) and counts it.
Each trial runs both variants back to back (in alternating order) and the overheads reported are the
medians of the per-trial ratios, since a shared CPU is noisy.

    python benchmarks/widget_overhead.py [--streams 8] [--tokens 300] [--trials 7] [--threads 1] [--no-token-view]
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import comm  # noqa: E402
import torch  # noqa: E402

from common import print_table, save  # noqa: E402
from pagednb import LLM, SamplingParams  # noqa: E402
from pagednb.notebook.throttle import max_in_window  # noqa: E402
from pagednb.notebook.token_view import DEFAULT_TOP_K  # noqa: E402

MESSAGES = [{"role": "user", "content": "Tell me a story about a dog named Max."}]


class KernelLikeComm(comm.DummyComm):
    """Encodes and signs each message as ipykernel's Session would, and records when it was sent."""
    sent: list[tuple[float, str]] = []
    _key = b"benchmark-key"

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        payload = json.dumps({"comm_id": self.comm_id, "data": data, **keys}, default=str).encode()
        hmac.new(self._key, payload, hashlib.sha256).hexdigest()
        KernelLikeComm.sent.append((time.monotonic(), msg_type))


class ViewClock:
    """Time spent inside the views' own code (throttle requests, renders, widget sends, pool refreshes),
    nested calls counted once: a direct measure of their cost that other processes' load barely moves."""
    seconds = 0.0
    _depth = 0

    @classmethod
    def wrap(cls, owner, name: str) -> None:
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            cls._depth += 1
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                cls._depth -= 1
                if cls._depth == 0:
                    cls.seconds += time.perf_counter() - start
        setattr(owner, name, timed)


def instrument_views() -> None:
    from pagednb.notebook.pool_view import PoolView
    from pagednb.notebook.stream_view import StreamView
    from pagednb.notebook.throttle import Throttle
    for name in ("request", "flush", "_try"):
        ViewClock.wrap(Throttle, name)
    ViewClock.wrap(PoolView, "_update")
    ViewClock.wrap(StreamView, "_finish")
    ViewClock.wrap(StreamView, "_show_tokens")


async def run_bare(llm: LLM, prompt, params: list[SamplingParams]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process, tokens)."""
    async def consume(p: SamplingParams) -> int:
        n = 0
        async for out in llm.stream(prompt, p):
            n = len(out.outputs[0].token_ids)
        return n
    start, cpu = time.perf_counter(), time.process_time()
    tokens = await asyncio.gather(*(consume(p) for p in params))
    return time.perf_counter() - start, time.process_time() - cpu, sum(tokens)


async def run_views(llm: LLM, prompt, params: list[SamplingParams], token_view: bool) -> tuple[float, float, int, dict]:
    from pagednb.notebook import pool_view, stream
    pool = pool_view(llm, display=False)
    first_message = len(KernelLikeComm.sent)
    clock = ViewClock.seconds
    start, cpu = time.perf_counter(), time.process_time()
    views = [stream(llm, prompt, p, display=False) for p in params]
    for view in views:
        view.token_button.value = token_view  # the click, as the browser syncs it
    outs = [await v for v in views]
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    pool.stop()
    sent = [t for t, kind in KernelLikeComm.sent[first_message:] if kind == "comm_msg"]
    text_updates = [v._text_throttle.renders for v in views]
    messages = {"messages": len(sent), "messages_per_s": len(sent) / elapsed,
                "max_messages_in_1s": max_in_window(sent, 1.0),
                "text_updates_per_stream_per_s": statistics.mean(text_updates) / elapsed,
                "view_time_fraction": (ViewClock.seconds - clock) / elapsed}
    return elapsed, cpu, sum(len(o.outputs[0].token_ids) for o in outs), messages


async def main(args) -> None:
    from pagednb.notebook.prompts import engine_prompt
    llm = LLM(num_kv_blocks=1024)
    prompt = engine_prompt(llm, MESSAGES)
    params = [SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.8, seed=i) for i in range(args.streams)]
    with_logprobs = [p.clone() for p in params]
    for p in with_logprobs:
        p.logprobs = DEFAULT_TOP_K  # what the views ask for
    await run_bare(llm, prompt, with_logprobs)  # warm-up: allocator, detokenizer, first-call paths
    bare, views, bare_cpu, views_cpu, msgs, no_logprobs = [], [], [], [], [], []
    for trial in range(args.trials):  # back to back, in alternating order: a drift in load hits all alike
        for variant in (("plain", "bare", "views") if trial % 2 == 0 else ("views", "bare", "plain")):
            if variant == "plain":
                elapsed, _, tokens = await run_bare(llm, prompt, params)
                no_logprobs.append(tokens / elapsed)
            elif variant == "bare":
                elapsed, cpu, tokens = await run_bare(llm, prompt, with_logprobs)
                bare.append(tokens / elapsed)
                bare_cpu.append(cpu / tokens * 1e3)
            else:
                elapsed, cpu, tokens, m = await run_views(llm, prompt, params, args.token_view)
                views.append(tokens / elapsed)
                views_cpu.append(cpu / tokens * 1e3)
                msgs.append(m)
    bare_tps, views_tps = statistics.median(bare), statistics.median(views)
    slowdown = statistics.median(1 - v / b for v, b in zip(views, bare))  # paired, per trial
    logprobs_cost = statistics.median(1 - b / p for b, p in zip(bare, no_logprobs))
    bare_ms, views_ms = statistics.median(bare_cpu), statistics.median(views_cpu)
    cpu_overhead = statistics.median(v / b - 1 for v, b in zip(views_cpu, bare_cpu))
    mps = statistics.median(m["messages_per_s"] for m in msgs)
    peak = max(m["max_messages_in_1s"] for m in msgs)
    text_hz = statistics.median(m["text_updates_per_stream_per_s"] for m in msgs)
    view_share = statistics.median(m["view_time_fraction"] for m in msgs)
    path = save("widget_overhead", {
        "streams": args.streams, "tokens_per_stream": args.tokens, "trials": args.trials,
        "token_view_open": args.token_view,
        "torch_threads": torch.get_num_threads(),
        "bare_tok_per_s": bare, "views_tok_per_s": views, "messages": msgs,
        "bare_without_logprobs_tok_per_s": no_logprobs, "engine_logprobs_slowdown": logprobs_cost,
        "bare_cpu_ms_per_token": bare_cpu, "views_cpu_ms_per_token": views_cpu,
        "median_bare_cpu_ms_per_token": bare_ms, "median_views_cpu_ms_per_token": views_ms,
        "cpu_overhead": cpu_overhead,
        "median_bare_tok_per_s": bare_tps, "median_views_tok_per_s": views_tps, "slowdown": slowdown,
        "median_messages_per_s": mps, "max_messages_in_any_1s": peak,
        "median_text_updates_per_stream_per_s": text_hz, "median_view_time_fraction": view_share,
    })
    print(f"wrote {path}")
    print_table(["variant", "tok/s (median)", "slowdown (paired median)", "CPU ms/token",
                 "CPU overhead (paired median)", "time in view code", "widget msgs/s", "max msgs in 1 s",
                 "text updates/stream/s"], [
        [f"{args.streams} bare llm.stream consumers, no logprobs", statistics.median(no_logprobs),
         f"-{logprobs_cost * 100:.1f}% (logprobs={DEFAULT_TOP_K} in the engine)", "—", "—", "—", 0, 0, "—"],
        [f"{args.streams} bare llm.stream consumers, logprobs={DEFAULT_TOP_K}", bare_tps, "—", bare_ms, "—", "—", 0, 0, "—"],
        [f"{args.streams} stream views{' (token view open)' if args.token_view else ''} + pool view", views_tps, f"{slowdown * 100:.1f}%", views_ms,
         f"{cpu_overhead * 100:.1f}%", f"{view_share * 100:.1f}%", round(mps), peak, round(text_hz, 1)],
    ])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-token-view", dest="token_view", action="store_false",
                        help="measure the views with their text shown, not the token view")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    comm.create_comm = KernelLikeComm  # every widget created from here on talks through it
    instrument_views()
    asyncio.run(main(args))
