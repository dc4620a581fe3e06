"""Speculative decoding with n-gram drafts: batch-1 tokens/s on a repetitive workload with and without it
(target >= 2x), and the standard workload at batch 256 with it on and off (target: no slowdown > 5%).

The repetitive workload is "continue a text the model has already written": random weights never copy a
prompt, so each prompt is a workload prompt followed by the model's own greedy continuation of it, and the
measured request continues that (its continuation repeats what came before, as an edit or a summary of a
given text does, and random-weight models fall into loops). `--model` measures a real model instead
(e.g. ../shared/llama2c/stories260K_hf with story prompts, whose stories repeat names and phrases).

    python benchmarks/spec_decode.py --shape qwen3-0.6b [--k 8] [--skip-standard]
    python benchmarks/spec_decode.py --shape tiny --prompts 2 --written 64 --max-tokens 64 --requests 8 --max-output 64
                                                               # a CPU smoke run of the script
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import print_table, save
from shapes import SHAPES, make_model_dir, workload

from pagednb import LLM, SamplingParams


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def repetitive_prompts(llm: LLM, vocab: int, n: int, prompt_len: int, written: int) -> list[list[int]]:
    """n workload prompts cut to prompt_len tokens, each followed by its own greedy continuation."""
    bases = [p[:prompt_len] for p in workload(n, vocab)[0]]
    outs = llm.generate(bases, SamplingParams(temperature=0, max_tokens=written, ignore_eos=True), use_tqdm=False)
    return [b + o.outputs[0].token_ids for b, o in zip(bases, outs)]


def batch1(llm: LLM, prompts, max_tokens: int) -> dict:
    """One request at a time; output tokens / wall time over all of them, and their tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[0][:32], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    before = llm.stats()
    tokens, wall = [], 0.0
    for prompt in prompts:
        _sync()
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        wall += time.perf_counter() - t0
        tokens.append(out.outputs[0].token_ids)
    stats = llm.stats()
    result = {"tok_per_s": sum(map(len, tokens)) / wall, "wall_s": wall, "steps": stats["steps"] - before["steps"]}
    if "spec_decode_num_drafts" in stats:
        drafts = stats["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        result.update(drafted=stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"],
                      accepted=accepted, mean_acceptance_length=1 + accepted / drafts if drafts else 0.0)
    return result, tokens


def standard(llm: LLM, vocab: int, requests: int, max_output: int | None) -> dict:
    """benchmarks/throughput.py's workload: temperature 0.6, the workload's output lengths (capped only for
    a smoke run), all at once."""
    prompts, outputs = workload(requests, vocab)
    outputs = [min(o, max_output or o) for o in outputs]
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs]
    llm.generate([p[:32] for p in prompts[:8]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    before = llm.stats()
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs)
    stats = llm.stats()
    return {"tok_per_s": produced / wall, "wall_s": wall, "steps": stats["steps"] - before["steps"],
            "drafted": stats.get("spec_decode_num_draft_tokens", 0) - before.get("spec_decode_num_draft_tokens", 0)}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine(model: str, spec: dict | None, args) -> LLM:
    return LLM(model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, speculative_config=spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--model", default=None, help="a model folder instead of a random-weight shape")
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--prompts", type=int, default=4, help="batch-1 requests, one after another")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--written", type=int, default=256, help="tokens of its own text in each prompt")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=256, help="standard workload requests")
    parser.add_argument("--max-output", type=int, default=None, help="caps its output lengths (smoke runs only)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--skip-standard", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_model_dir(args.shape, Path(tmp) / args.shape))
        name = Path(args.model).name if args.model else args.shape
        results = {"model": name, "k": args.k}
        with engine(model, None, args) as llm:  # one engine at a time: each sizes its pool to the GPU
            vocab = llm.engine.spec.vocab_size
            prompts = repetitive_prompts(llm, vocab, args.prompts, args.prompt_len, args.written)
            results["batch1_plain"], plain_tokens = batch1(llm, prompts, args.max_tokens)
            if not args.skip_standard:
                results["standard_plain"] = standard(llm, vocab, args.requests, args.max_output)
        with engine(model, ngram(args.k), args) as llm:
            results["batch1_spec"], spec_tokens = batch1(llm, prompts, args.max_tokens)
            if not args.skip_standard:
                results["standard_spec"] = standard(llm, vocab, args.requests, args.max_output)
    results["batch1_speedup"] = results["batch1_spec"]["tok_per_s"] / results["batch1_plain"]["tok_per_s"]
    # greedy: the same tokens (bf16 may flip a near-tie; the count says how often)
    results["batch1_identical_outputs"] = sum(a == b for a, b in zip(plain_tokens, spec_tokens))
    results["batch1_first_divergence"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                                          for a, b in zip(plain_tokens, spec_tokens)]
    plain = results["batch1_plain"]
    rows = [["batch 1, repetitive", "off", plain["tok_per_s"], plain["steps"], "", ""],
            ["batch 1, repetitive", f"ngram k={args.k}", results["batch1_spec"]["tok_per_s"],
             results["batch1_spec"]["steps"], results["batch1_spec"]["mean_acceptance_length"],
             f"{results['batch1_speedup']:.2f}x (target >= 2x)"]]
    if not args.skip_standard:
        ratio = results["standard_spec"]["tok_per_s"] / results["standard_plain"]["tok_per_s"]
        results["standard_ratio"] = ratio
        rows += [[f"standard, {args.requests} requests", "off", results["standard_plain"]["tok_per_s"],
                  results["standard_plain"]["steps"], "", ""],
                 [f"standard, {args.requests} requests", f"ngram k={args.k}", results["standard_spec"]["tok_per_s"],
                  results["standard_spec"]["steps"], "", f"{ratio:.3f}x (target >= 0.95x)"]]
    print(f"\n{name}: speculative decoding (n-gram, k={args.k}); batch-1 greedy outputs identical: "
          f"{results['batch1_identical_outputs']}/{len(prompts)} (first differing token of each: "
          f"{results['batch1_first_divergence']} of {args.max_tokens})")
    print_table(["workload", "spec decode", "output tok/s", "steps", "mean acceptance length", "vs off"], rows)
    print(f"wrote {save(f'spec_decode_{name}' + ('_batch1' if args.skip_standard else ''), results)}")


if __name__ == "__main__":
    main()
