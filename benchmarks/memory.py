"""KV memory efficiency: at the workload's peak, the share of allocated KV slots that hold real tokens,
beside what reserving max_model_len contiguously per request (or each request's own final length)
would need for the same running requests.

    python benchmarks/memory.py --shape qwen3-0.6b [--requests 256]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import print_table, save
from shapes import SHAPES, make_model_dir, workload

from pagednb import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    prompts, outputs = workload(args.requests, SHAPES[args.shape]["vocab_size"])
    peak = {"used_blocks": -1}
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_model_dir(args.shape, Path(tmp) / args.shape)), max_model_len=args.max_model_len)
        engine, real_step = llm.engine, llm.engine.step
        block_size = engine.config.block_size

        def step():  # after every step: how full are the blocks the running requests hold?
            outs = real_step()
            used = engine.stats()["used_blocks"]
            if used > peak["used_blocks"]:
                running = engine.scheduler.running
                peak.update(used_blocks=used, tokens=sum(r.num_computed_tokens for r in running),
                            running=len(running),
                            final_lengths=sum(r.num_prompt_tokens + r.max_tokens for r in running))
            return outs
        engine.step = step
        llm.generate(prompts, [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs],
                     use_tqdm=False)
        llm.close()
    slots = peak["used_blocks"] * block_size
    contiguous = peak["running"] * args.max_model_len
    result = {**peak, "block_size": block_size, "allocated_slots": slots, "paged_share": peak["tokens"] / slots,
              "contiguous_max_len_slots": contiguous, "contiguous_max_len_share": peak["tokens"] / contiguous,
              "reserve_final_length_share": peak["tokens"] / peak["final_lengths"]}
    print(f"\nPeak of the standard workload ({args.requests} requests), {peak['running']} running (target >= 97%)")
    print_table(["allocation", "slots", "share holding real tokens"],
                [["paged (pagednb)", slots, result["paged_share"]],
                 [f"contiguous, max_model_len={args.max_model_len}", contiguous, result["contiguous_max_len_share"]],
                 ["contiguous, each request's final length", peak["final_lengths"], result["reserve_final_length_share"]]])
    print(f"wrote {save(f'memory_{args.shape}', {'shape': args.shape, **result})}")


if __name__ == "__main__":
    main()
