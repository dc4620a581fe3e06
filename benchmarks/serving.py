"""Serving over HTTP: the standard workload sent to `llm.serve()` (the server on this process's running
event loop, as in a notebook kernel) by client processes, against the offline `generate` figure of the
same run.

    python benchmarks/serving.py --shape qwen3-0.6b              # GPU: Poisson 4, 16, 64 req/s + as fast as possible
    python benchmarks/serving.py --shape tiny --requests 16 --poisson-requests 8 --max-output 32   # CPU smoke test

Every request streams (SSE, `stream_options.include_usage`), temperature 0.6, `ignore_eos`, so the token
counts are the workload's. TTFT is the first chunk's arrival; TPOT is (last chunk - first chunk) / (tokens
- 1) per request. The as-fast-as-possible run sends the whole workload at once; its output tok/s is the
completion tokens over the time from the first send to the last [DONE], the same measure as `generate`'s
wall time. The clients run in other processes (plain httpx, counting SSE lines; the usage chunk alone is
parsed), so the figure is the server's, not the cost of parsing chunks in the engine's own process.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import tempfile
import time
from pathlib import Path

# Only the standard library at the top: the client processes (spawned) import this file again, and
# should start in a moment, without torch.


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


# ---- the client processes --------------------------------------------------------------------------
async def _one(http, url: str, model: str, prompt: list[int], max_tokens: int, start: float, delay: float) -> dict:
    await asyncio.sleep(max(0.0, start + delay - time.time()))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.6, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.time()
    first = last = None
    last_data = ""
    async with http.stream("POST", url + "/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            last = time.time()
            if first is None:
                first = last
            last_data = data
    tokens = json.loads(last_data)["usage"]["completion_tokens"]
    return {"sent": sent, "first": first, "last": last, "tokens": tokens}


async def _client_main(url: str, model: str, jobs: list[tuple], start: float) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        return await asyncio.gather(*(_one(http, url, model, p, m, start, d) for p, m, d in jobs))


def _client_process(url: str, model: str, jobs: list[tuple], start: float, results) -> None:
    results.put(asyncio.run(_client_main(url, model, jobs, start)))


async def send(url: str, model: str, prompts, max_tokens, delays, processes: int) -> list[dict]:
    """Sends request i at start + delays[i] from `processes` client processes; their records."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    start = time.time() + 2.0  # every process is up by then
    jobs = list(zip(prompts, max_tokens, delays))
    procs = [ctx.Process(target=_client_process, args=(url, model, jobs[i::processes], start, results))
             for i in range(processes)]
    for proc in procs:
        proc.start()
    records = []
    for _ in procs:
        records += await asyncio.to_thread(results.get)
    for proc in procs:
        await asyncio.to_thread(proc.join)
    return records


def summarize(records: list[dict], name: str, rate: float | None) -> dict:
    begin = min(r["sent"] for r in records)
    end = max(r["last"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    ttft = [(r["first"] - r["sent"]) * 1e3 for r in records]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) * 1e3 for r in records if r["tokens"] > 1]
    return {"run": name, "rate": rate, "requests": len(records), "output_tokens": tokens, "wall_s": end - begin,
            "output_tok_per_s": tokens / (end - begin),
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99)}


# ---- the server side -------------------------------------------------------------------------------
def offline(llm, prompts, outputs) -> dict:
    import torch

    from pagednb import SamplingParams

    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs]
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs)
    return {"run": "offline generate", "rate": None, "requests": len(prompts), "output_tokens": produced,
            "wall_s": wall, "output_tok_per_s": produced / wall}


async def over_http(llm, prompts, outputs, args) -> list[dict]:
    server = llm.serve(port=0)
    try:
        await send(server.url, server.model_name, [prompts[0][:32]], [8], [0.0], 1)  # warm-up
        runs = [summarize(await send(server.url, server.model_name, prompts, outputs, [0.0] * len(prompts),
                                     args.client_processes), "HTTP, as fast as possible", None)]
        n = args.poisson_requests
        capped = [min(o, args.max_output) for o in outputs[:n]]
        for seed, rate in enumerate(float(r) for r in args.rates.split(",")):
            rng, t, delays = random.Random(seed), 0.0, []
            for _ in range(n):
                t += rng.expovariate(rate)
                delays.append(t)
            records = await send(server.url, server.model_name, prompts[:n], capped, delays, args.client_processes)
            runs.append(summarize(records, f"HTTP, Poisson {rate:g} req/s", rate))
    finally:
        server.stop()
        await server.wait_stopped()
    return runs


def main() -> None:
    from common import print_table, save
    from shapes import SHAPES, make_model_dir, workload

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=256, help="the as-fast-as-possible run and offline generate")
    parser.add_argument("--poisson-requests", type=int, default=100, help="requests per Poisson rate")
    parser.add_argument("--rates", default="4,16,64", help="Poisson arrivals per second")
    parser.add_argument("--max-output", type=int, default=256, help="output cap in the Poisson runs")
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = parser.parse_args()
    from pagednb import LLM, SamplingParams

    prompts, outputs = workload(args.requests, SHAPES[args.shape]["vocab_size"])
    if args.shape == "tiny":
        outputs = [min(o, args.max_output) for o in outputs]  # a smoke test: short outputs on the CPU
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args.shape, Path(tmp) / args.shape)
        # Prefix caching off: every run replays the same prompts, and a later run must not find an
        # earlier one's prompts cached (the workload's random prompts share nothing within one run).
        llm = LLM(str(model_dir), max_model_len=2048, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.9,
                  enable_prefix_caching=False)
        llm.generate([p[:32] for p in prompts[:8]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        base = offline(llm, prompts, outputs)
        runs = [base] + asyncio.run(over_http(llm, prompts, outputs, args))
        llm.close()
    fast = runs[1]
    fast["vs_offline"] = fast["output_tok_per_s"] / base["output_tok_per_s"]
    print_table(["run", "requests", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"],
                [[r["run"], r["requests"], r["output_tok_per_s"], r.get("ttft_p50_ms", "-"), r.get("ttft_p99_ms", "-"),
                  r.get("tpot_p50_ms", "-"), r.get("tpot_p99_ms", "-")] for r in runs])
    print(f"as fast as possible over HTTP: {fast['vs_offline']:.1%} of offline generate (target >= 85%)")
    path = save(f"serving_{args.shape}", {"shape": args.shape, "requests": args.requests, "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
