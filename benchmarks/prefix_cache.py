"""Prefix caching: 256 requests sharing a 1,000-token system prompt (plus a unique 20-100 token
question each), prefill throughput with the prefix cache vs without, and the hit rate.

    python benchmarks/prefix_cache.py --shape qwen3-0.6b [--requests 256]
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from common import print_table, save
from shapes import SHAPES, make_model_dir

from pagednb import LLM, SamplingParams


def requests(n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(vocab) for _ in range(1000)]
    return [system + [rng.randrange(vocab) for _ in range(rng.randint(20, 100))] for _ in range(n)]


def prefill_run(model_dir: Path, prompts: list[list[int]], caching: bool) -> dict:
    llm = LLM(str(model_dir), max_model_len=2048, enable_prefix_caching=caching)
    llm.generate([p[-64:] for p in prompts[:4]], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up
    before = llm.stats()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t0
    after = llm.stats()
    llm.close()
    queried = after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"]
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    tokens = sum(map(len, prompts))
    return {"wall_s": wall, "prompt_tokens": tokens, "prefill_tok_per_s": tokens / wall,
            "computed_tokens": after["computed_tokens"] - before["computed_tokens"],
            "hit_rate": hits / queried if queried else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args()
    prompts = requests(args.requests, SHAPES[args.shape]["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args.shape, Path(tmp) / args.shape)
        runs = {"with prefix cache": prefill_run(model_dir, prompts, True),
                "without": prefill_run(model_dir, prompts, False)}
    speedup = runs["with prefix cache"]["prefill_tok_per_s"] / runs["without"]["prefill_tok_per_s"]
    print(f"\n{args.requests} requests sharing a 1,000-token system prompt (target: >= 4x with caching)")
    print_table(["run", "prompt tokens", "tokens computed", "wall s", "prefill tok/s", "hit rate"],
                [[k, r["prompt_tokens"], r["computed_tokens"], r["wall_s"], r["prefill_tok_per_s"], r["hit_rate"]]
                 for k, r in runs.items()])
    print(f"speed-up {speedup:.2f}x")
    print(f"wrote {save(f'prefix_cache_{args.shape}', {'shape': args.shape, 'runs': runs, 'speedup': speedup})}")


if __name__ == "__main__":
    main()
