"""How closely an fp8 (e4m3) KV cache follows a 16-bit one, beside how closely two equally valid 16-bit runs
follow each other: the noise floor of the issue's measure.

The issue's measure: the share of greedy tokens before each completion's first divergence (10 prompts x 50
tokens). A greedy completion leaves another at the first near-tie of their logits that the two round
differently, so the measure also moves when nothing but the order of float additions changes. This script
puts the fp8 figure beside pairs that differ only in such rounding:
- `bf16: cuda kernels vs torch reference`: the same bf16 cache read by the CUDA kernels and by the pure-torch
  reference (the same math, other summation order);
- `bf16 model vs float32 model`: the model's own precision.
and the fp8 figures in float32, where rounding noise is small and the cache format is the only difference.

    python benchmarks/fp8_accuracy.py [--llama2c ../shared/llama2c/stories260K_hf]     # GPU
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from common import print_table, save

from pagednb import LLM, SamplingParams

PROMPTS = ["Once upon a time", "Tom and Lily", "One day, a little girl named Lily", "The cat",
           "Sam had a big red ball.", "Once upon a time, there was a little boy named Tim.",
           "The sun was shining", "Mom said", "Tell me a story about a cat named Tom.",
           "What is the capital of France?"]
DEFAULT_LLAMA2C = os.environ.get("PAGEDNB_TEST_LLAMA2C", str(Path(__file__).resolve().parents[2] / "shared" /
                                                             "llama2c" / "stories260K_hf"))
# (run name, LLM options): the cache format, the model's dtype and the attention backend
RUNS = {"bf16": dict(dtype="bfloat16"),
        "fp8": dict(dtype="bfloat16", kv_cache_dtype="fp8"),
        "bf16 on the torch reference": dict(dtype="bfloat16", attention_backend="torch_ref"),
        "float32": dict(dtype="float32"),
        "fp8, float32 model": dict(dtype="float32", kv_cache_dtype="fp8")}
# (what is compared, the base run, the other run)
PAIRS = [("fp8 vs bf16 cache, bf16 model (the issue's measure)", "bf16", "fp8"),
         ("bf16: cuda kernels vs torch reference (noise floor)", "bf16", "bf16 on the torch reference"),
         ("bf16 model vs float32 model (noise floor)", "float32", "bf16"),
         ("fp8 vs float32 cache, float32 model", "float32", "fp8, float32 model")]


def completions(model: str | None, options: dict) -> list[list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    with LLM(model, num_kv_blocks=1024, **options) as llm:
        prompts = list(PROMPTS)
        if model is not None:  # stories260K's own story from its BOS token first
            prompts = [{"prompt_token_ids": [llm.get_tokenizer().bos_token_id]}] + prompts
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]


def prefix_share(base: list[list[int]], other: list[list[int]]) -> float:
    """Tokens of base before each completion's first difference from other, over all of base's tokens."""
    same = 0
    for x, y in zip(base, other):
        same += next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
    return same / sum(map(len, base))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama2c", default=DEFAULT_LLAMA2C, help="stories260K as an HF folder (skipped if absent)")
    args = ap.parse_args()
    models = {"embedded default model": None}
    if Path(args.llama2c).is_dir():
        models["stories260K"] = args.llama2c
    else:
        print(f"no stories260K folder at {args.llama2c}: the embedded model only")
    results, rows = {}, []
    for label, model in models.items():
        runs = {name: completions(model, options) for name, options in RUNS.items()}
        results[label] = {what: prefix_share(runs[base], runs[other]) for what, base, other in PAIRS}
        rows += [[label, what, f"{100 * share:.1f}%"] for what, share in results[label].items()]
    print_table(["model", "pair", "tokens before the first divergence"], rows)
    path = save("fp8_accuracy", {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                 "prompts": len(PROMPTS), "max_tokens": 50, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
