"""Latency: batch-1 time per output token (512-token prompt, 256 new tokens), then TTFT and TPOT p50 /
p99 under Poisson arrivals at three rates (requests from the standard workload, outputs capped).

    python benchmarks/latency.py --shape qwen3-0.6b [--requests 100] [--rates 4,16,64]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from pathlib import Path

from common import print_table, save
from shapes import SHAPES, make_model_dir, workload

from pagednb import LLM, SamplingParams


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def batch1_tpot(llm: LLM, vocab: int) -> dict:
    prompt = [i % vocab for i in range(512)]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)  # warm-up
    runs = []
    for _ in range(3):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        m = out.metrics
        runs.append({"ttft_ms": m.time_to_first_token * 1e3,
                     "tpot_ms": (m.finished_time - m.first_token_time) / 255 * 1e3})
    return {"runs": runs, "tpot_ms": statistics.median(r["tpot_ms"] for r in runs),
            "ttft_ms": statistics.median(r["ttft_ms"] for r in runs)}


async def poisson(llm: LLM, prompts, outputs, rate: float, seed: int) -> dict:
    rng = random.Random(seed)

    async def one(prompt, max_tokens, delay):
        await asyncio.sleep(delay)
        return await llm.agenerate(prompt, SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True))
    delays, t = [], 0.0
    for _ in prompts:
        t += rng.expovariate(rate)
        delays.append(t)
    outs = await asyncio.gather(*(one(p, o, d) for p, o, d in zip(prompts, outputs, delays)))
    ttft = [o.metrics.time_to_first_token * 1e3 for o in outs]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1) * 1e3
            for o in outs]
    return {"rate": rate, "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--rates", default="4,16,64", help="arrivals per second")
    parser.add_argument("--max-output", type=int, default=256, help="caps the workload's output lengths")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                        help="LLM(kv_cache_dtype=...): 'fp8' stores K/V as float8 e4m3")
    args = parser.parse_args()
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts, outputs = workload(args.requests, vocab)
    outputs = [min(o, args.max_output) for o in outputs]
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_model_dir(args.shape, Path(tmp) / args.shape)), max_model_len=2048,
                  kv_cache_dtype=args.kv_cache_dtype)
        single = batch1_tpot(llm, vocab)
        loads = [asyncio.run(poisson(llm, prompts, outputs, float(r), seed=i))
                 for i, r in enumerate(args.rates.split(","))]
        llm.close()
    print(f"\nBatch 1, 512-token prompt, 256 tokens: TPOT {single['tpot_ms']:.3f} ms, TTFT {single['ttft_ms']:.1f} ms"
          " (target TPOT <= 1.5 ms on the Qwen3-0.6B shape)")
    print(f"Poisson arrivals, {args.requests} requests each, outputs capped at {args.max_output}")
    print_table(["rate req/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"],
                [[r["rate"], r["ttft_p50_ms"], r["ttft_p99_ms"], r["tpot_p50_ms"], r["tpot_p99_ms"]] for r in loads])
    name = f"latency_{args.shape}" + ("" if args.kv_cache_dtype == "auto" else f"_kv_{args.kv_cache_dtype}")
    result = {"shape": args.shape, "kv_cache_dtype": args.kv_cache_dtype, "batch1": single, "poisson": loads}
    print(f"wrote {save(name, result)}")


if __name__ == "__main__":
    main()
