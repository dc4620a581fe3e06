"""Offline throughput on the standard workload (nano-vllm's bench, ../shared/anchors): 256 requests,
prompt and output lengths uniform in [100, 1024], random token ids, seed 0, temperature 0.6, EOS
ignored; throughput = output tokens / wall time (prefill included). Random bf16 weights of the
Qwen3-0.6B or Llama-3.2-1B shape (the cost does not depend on the values; nothing is downloaded).

    python benchmarks/throughput.py --shape qwen3-0.6b [--requests 256]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import print_table, save
from shapes import SHAPES, make_model_dir, workload


def run_pagednb(model_dir: Path, prompts, outputs, args) -> dict:
    from pagednb import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(model_dir), max_model_len=2048, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.9)
    startup = time.perf_counter() - t0
    llm.generate([p[:32] for p in prompts[:8]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs]
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs)
    stats = llm.stats()
    llm.close()
    return {"wall_s": wall, "output_tok_per_s": produced / wall,
            "total_tok_per_s": (produced + sum(map(len, prompts))) / wall, "startup_s": startup,
            "steps": stats["steps"], "preemptions": stats["preemptions"], "kv_blocks": stats["num_blocks"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = parser.parse_args()
    prompts, outputs = workload(args.requests, SHAPES[args.shape]["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args.shape, Path(tmp) / args.shape)
        result = run_pagednb(model_dir, prompts, outputs, args)
    rows = [["pagednb", args.shape, args.requests, sum(outputs), result["wall_s"], result["output_tok_per_s"],
             result["steps"], result["preemptions"]]]
    print(f"\nThroughput, {args.requests} requests, {sum(map(len, prompts))} prompt + {sum(outputs)} output tokens")
    print_table(["engine", "shape", "requests", "output tokens", "wall s", "output tok/s", "steps", "preemptions"], rows)
    path = save(f"throughput_{args.shape}", {"shape": args.shape, "requests": args.requests,
                                               "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outputs),
                                               "pagednb": result})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
