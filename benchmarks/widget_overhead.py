"""What the notebook views cost the engine: N concurrent streams of the embedded model, consumed bare
(`async for out in llm.stream(...)`) vs shown in live stream views, with every other view open beside
them (pool view, prefix-cache tree, step debugger while the engine runs, memory planner), and the widget
messages per second the views send.

By default the streams show their text (the views' default): their requests ask for no logprobs, and the
slowdown is measured against bare consumers of the same requests, which is what a notebook user pays.
`--token-view` opens the streams with `stream(..., token_view=True)`: the tokens drawn live, coloured by
probability, with the top-5 alternatives the views then ask the engine for; the views alone are then
measured against bare consumers asking for the same logprobs, and the whole against bare consumers
without them. What the logprobs cost the engine by itself is a variant of its own in both modes (on
the tiny CPU model a step is so cheap that the top-5 logprobs are a visible part of it).

No browser is attached, so every widget message goes through a comm that does what ipykernel does
with it on the kernel's side (JSON-encode the content, sign it with HMAC-SHA256) and counts it.
Each trial runs the variants back to back (in alternating order) and the overheads reported are the
medians of the per-trial ratios, since a shared CPU is noisy.

    python benchmarks/widget_overhead.py [--streams 8] [--tokens 300] [--trials 7] [--threads 1] [--token-view]
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
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
    by_entry: dict[str, float] = {}  # the same time, by the outermost entry point it was spent under
    _depth = 0

    @classmethod
    def wrap(cls, owner, name: str) -> None:
        real = getattr(owner, name)
        entry = f"{owner.__name__}.{name}"

        def timed(*args, **kwargs):
            cls._depth += 1
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                cls._depth -= 1
                if cls._depth == 0:
                    spent = time.perf_counter() - start
                    cls.seconds += spent
                    cls.by_entry[entry] = cls.by_entry.get(entry, 0.0) + spent
        setattr(owner, name, timed)


def instrument_views() -> None:
    from pagednb.notebook.pool_view import PoolView
    from pagednb.notebook.prefix_tree import PrefixTreeView
    from pagednb.notebook.step_view import StepView
    from pagednb.notebook.stream_view import StreamView
    from pagednb.notebook.throttle import Throttle
    for name in ("request", "flush", "_try"):
        ViewClock.wrap(Throttle, name)
    ViewClock.wrap(PoolView, "_update")
    ViewClock.wrap(StreamView, "_finish")
    ViewClock.wrap(StreamView, "_show_tokens")
    ViewClock.wrap(PrefixTreeView, "refresh")
    ViewClock.wrap(StepView, "_draw")


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
    from pagednb.notebook import planner_view, pool_view, prefix_tree, step_view, stream
    pool = pool_view(llm, display=False)
    tree = prefix_tree(llm, display=False)
    debugger = step_view(llm, pause=False, display=False)  # running: it listens only while paused
    planner_view(llm, display=False)  # redraws on its sliders only
    first_message = len(KernelLikeComm.sent)
    clock, by_entry = ViewClock.seconds, dict(ViewClock.by_entry)
    start, cpu = time.perf_counter(), time.process_time()
    views = [stream(llm, prompt, p, token_view=token_view, display=False) for p in params]
    outs = [await v for v in views]
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    pool.stop()
    tree.stop()
    debugger.close()
    sent = [t for t, kind in KernelLikeComm.sent[first_message:] if kind == "comm_msg"]
    text_updates = [v._text_throttle.renders for v in views]
    messages = {"messages": len(sent), "messages_per_s": len(sent) / elapsed,
                "max_messages_in_1s": max_in_window(sent, 1.0),
                "text_updates_per_stream_per_s": statistics.mean(text_updates) / elapsed,
                "view_time_fraction": (ViewClock.seconds - clock) / elapsed,
                "view_time_fraction_by_entry": {name: (spent - by_entry.get(name, 0.0)) / elapsed
                                                for name, spent in ViewClock.by_entry.items()}}
    return elapsed, cpu, sum(len(o.outputs[0].token_ids) for o in outs), messages


async def main(args) -> None:
    from pagednb.notebook.prompts import engine_prompt
    llm = LLM(num_kv_blocks=1024)
    prompt = engine_prompt(llm, MESSAGES)
    params = [SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.8, seed=i) for i in range(args.streams)]
    with_logprobs = [p.clone() for p in params]
    for p in with_logprobs:
        p.logprobs = DEFAULT_TOP_K  # what the views ask for with their token view open
    await run_bare(llm, prompt, with_logprobs)  # warm-up: allocator, detokenizer, first-call paths
    tps: dict[str, list[float]] = {"plain": [], "logprobs": [], "views": []}
    cpu_ms: dict[str, list[float]] = {"plain": [], "logprobs": [], "views": []}
    msgs = []
    for trial in range(args.trials):  # back to back, in alternating order: a drift in load hits all alike
        for variant in (("plain", "logprobs", "views") if trial % 2 == 0 else ("views", "logprobs", "plain")):
            if variant == "views":
                elapsed, cpu, tokens, m = await run_views(llm, prompt, params, args.token_view)
                msgs.append(m)
            else:
                elapsed, cpu, tokens = await run_bare(llm, prompt, params if variant == "plain" else with_logprobs)
            tps[variant].append(tokens / elapsed)
            cpu_ms[variant].append(cpu / tokens * 1e3)
    same = "logprobs" if args.token_view else "plain"  # bare consumers of the requests the views make

    def paired_slowdown(variant: str, baseline: str) -> float:
        return statistics.median(1 - v / b for v, b in zip(tps[variant], tps[baseline]))
    slowdown, total, logprobs_cost = (paired_slowdown("views", same), paired_slowdown("views", "plain"),
                                      paired_slowdown("logprobs", "plain"))
    cpu_overhead = statistics.median(v / b - 1 for v, b in zip(cpu_ms["views"], cpu_ms[same]))
    median = {variant: statistics.median(values) for variant, values in tps.items()}
    median_cpu = {variant: statistics.median(values) for variant, values in cpu_ms.items()}
    mps = statistics.median(m["messages_per_s"] for m in msgs)
    peak = max(m["max_messages_in_1s"] for m in msgs)
    text_hz = statistics.median(m["text_updates_per_stream_per_s"] for m in msgs)
    view_share = statistics.median(m["view_time_fraction"] for m in msgs)
    share_by_entry = {name: statistics.median(m["view_time_fraction_by_entry"].get(name, 0.0) for m in msgs)
                      for name in ViewClock.by_entry}
    path = save("widget_overhead", {
        "streams": args.streams, "tokens_per_stream": args.tokens, "trials": args.trials,
        "token_view_open": args.token_view, "views_ask_for_logprobs": args.token_view,
        "torch_threads": torch.get_num_threads(), "load_average_1min_at_end": os.getloadavg()[0],
        "bare_tok_per_s": tps["plain"], "bare_with_logprobs_tok_per_s": tps["logprobs"],
        "views_tok_per_s": tps["views"], "messages": msgs,
        "bare_cpu_ms_per_token": cpu_ms["plain"], "bare_with_logprobs_cpu_ms_per_token": cpu_ms["logprobs"],
        "views_cpu_ms_per_token": cpu_ms["views"],
        "median_tok_per_s": median, "median_cpu_ms_per_token": median_cpu,
        "slowdown": slowdown, "slowdown_vs_no_logprobs": total, "engine_logprobs_slowdown": logprobs_cost,
        "cpu_overhead": cpu_overhead,
        "median_messages_per_s": mps, "max_messages_in_any_1s": peak,
        "median_text_updates_per_stream_per_s": text_hz, "median_view_time_fraction": view_share,
        "median_view_time_fraction_by_entry": share_by_entry,
    })
    print(f"wrote {path}")
    views_name = (f"{args.streams} stream views{' (token view open)' if args.token_view else ''} + pool, "
                  "prefix tree, step debugger (running), planner")
    print_table(["variant", "tok/s (median)", "slowdown vs no logprobs (paired median)",
                 "slowdown vs bare, same requests", "CPU ms/token", "CPU overhead, same requests",
                 "time in view code", "widget msgs/s", "max msgs in 1 s", "text updates/stream/s"], [
        [f"{args.streams} bare llm.stream consumers, no logprobs", median["plain"], "(baseline)", "—",
         median_cpu["plain"], "—", "—", 0, 0, "—"],
        [f"{args.streams} bare llm.stream consumers, logprobs={DEFAULT_TOP_K}", median["logprobs"],
         f"{logprobs_cost * 100:.1f}% (the engine's logprobs)", "—", median_cpu["logprobs"], "—", "—", 0, 0, "—"],
        [views_name, median["views"], f"{total * 100:.1f}%", f"{slowdown * 100:.1f}%", median_cpu["views"],
         f"{cpu_overhead * 100:.1f}%", f"{view_share * 100:.1f}%", round(mps), peak, round(text_hz, 1)],
    ])
    print("time in view code by entry point (median share of the loop): " + ", ".join(
        f"{name} {share * 100:.2f}%" for name, share in sorted(share_by_entry.items(), key=lambda kv: -kv[1])))

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--token-view", action="store_true",
                        help="open the streams with their token view (the engine then computes logprobs)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    comm.create_comm = KernelLikeComm  # every widget created from here on talks through it
    instrument_views()
    asyncio.run(main(args))
