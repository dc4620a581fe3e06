"""Prefix caching: 256 requests sharing a 1,000-token system prompt (plus a unique 20-100 token
question each), prefill throughput with the prefix cache vs without, and the hit rate.

    python benchmarks/prefix_cache.py --shape qwen3-0.6b [--requests 256] [--passes 5]
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import print_table, recorded_steps, save, step_breakdown
from shapes import SHAPES, make_model_dir

from pagednb import LLM, SamplingParams


def requests(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(1000)]
    return [system + [rng.randrange(vocab) for _ in range(rng.randint(20, 100))] for _ in range(n)]


def prefill_run(model_dir: Path, prompt_sets: list[list[list[int]]], caching: bool, warmup_prompts: list[list[int]],
                breakdown_prompts: list[list[int]] | None = None) -> dict:
    """Times the prefill of each prompt set (each with its own system prompt) in one engine; the median
    pass is the figure (a cached pass is ~0.1 s, so one pass alone varies by tens of percent)."""
    llm = LLM(str(model_dir), max_model_len=2048, enable_prefix_caching=caching)
    # Warm-up at full size, on prompts with another system prompt (nothing of it can be reused below):
    # the first large steps of a process pay one-time costs that would otherwise land on the first pass.
    llm.generate(warmup_prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    before = llm.stats()
    walls = []
    for prompts in prompt_sets:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        walls.append(time.perf_counter() - t0)
    after = llm.stats()
    breakdown = None
    if breakdown_prompts is not None:  # again, each step timed, on prompts of a fresh system prompt
        with recorded_steps(llm) as steps:
            t1 = time.perf_counter()
            llm.generate(breakdown_prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
            breakdown = {"wall_s": time.perf_counter() - t1, **step_breakdown(steps)}
    llm.close()
    queried = after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"]
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    tokens = sum(map(len, prompt_sets[0]))  # every set has the same lengths
    wall = statistics.median(walls)
    return {"wall_s": wall, "walls_s": walls, "prompt_tokens": tokens, "prefill_tok_per_s": tokens / wall,
            "computed_tokens": (after["computed_tokens"] - before["computed_tokens"]) / len(prompt_sets),
            "hit_rate": hits / queried if queried else 0.0, "breakdown": breakdown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--passes", type=int, default=5, help="timed passes of each run, each with another "
                        "system prompt (the median is reported)")
    parser.add_argument("--breakdown", action="store_true", help="a second run of each, with each step timed")
    args = parser.parse_args()
    prompt_sets = [requests(args.requests, SHAPES[args.shape]["vocab_size"], seed=10 * i) for i in range(args.passes)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args.shape, Path(tmp) / args.shape)
        vocab = SHAPES[args.shape]["vocab_size"]
        warmup = requests(args.requests, vocab, seed=2)
        other = requests(args.requests, vocab, seed=1) if args.breakdown else None
        runs = {"with prefix cache": prefill_run(model_dir, prompt_sets, True, warmup, other),
                "without": prefill_run(model_dir, prompt_sets, False, warmup, other)}
    speedup = runs["with prefix cache"]["prefill_tok_per_s"] / runs["without"]["prefill_tok_per_s"]
    print(f"\n{args.requests} requests sharing a 1,000-token system prompt (target: >= 4x with caching)")
    print_table(["run", "prompt tokens", "tokens computed", "median wall s", "passes (s)", "prefill tok/s", "hit rate"],
                [[k, r["prompt_tokens"], r["computed_tokens"], r["wall_s"], " ".join(f"{w:.3f}" for w in r["walls_s"]),
                  r["prefill_tok_per_s"], r["hit_rate"]] for k, r in runs.items()])
    print(f"speed-up {speedup:.2f}x")
    for name, r in runs.items():
        if r["breakdown"]:
            b = r["breakdown"]
            print(f"{name}, timed steps: wall {b['wall_s']:.3f} s; " + "; ".join(
                f"{k}: {v['steps']} steps, GPU {v['gpu_s']:.3f} s, wall {v['wall_s']:.3f} s"
                for k, v in b.items() if isinstance(v, dict)))
    print(f"wrote {save(f'prefix_cache_{args.shape}', {'shape': args.shape, 'runs': runs, 'speedup': speedup})}")


if __name__ == "__main__":
    main()
