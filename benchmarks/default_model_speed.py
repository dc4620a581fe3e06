"""Single-stream decode speed of the embedded default model on this machine's CPU (target >= 100 tok/s).

    python benchmarks/default_model_speed.py [--tokens 256] [--runs 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

from common import print_table, save

from pagednb import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    llm = LLM()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompt = [{"role": "user", "content": "Tell me a story about a cat named Tom."}]
    llm.chat(prompt, params, use_tqdm=False)  # warm-up
    rows = []
    for _ in range(args.runs):
        engine = llm.engine
        t0 = time.perf_counter()
        out = llm.chat(prompt, params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - t0
        ttft = out.metrics.time_to_first_token
        decode = (out.metrics.finished_time - out.metrics.first_token_time) / (len(out.outputs[0].token_ids) - 1)
        rows.append({"tok_per_s": len(out.outputs[0].token_ids) / elapsed, "ttft_ms": ttft * 1e3,
                     "tpot_ms": decode * 1e3})
        assert engine.stats()["used_blocks"] == 0
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"\nEmbedded model, batch 1, {args.tokens} output tokens, {args.runs} runs (median)")
    print_table(["tok/s (end to end)", "TTFT ms", "TPOT ms"], [[median["tok_per_s"], median["ttft_ms"], median["tpot_ms"]]])
    path = save("default_model_speed", {"tokens": args.tokens, "runs": rows, "median": median, "target_tok_per_s": 100})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
