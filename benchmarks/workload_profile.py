"""Where the standard workload's GPU time goes: every kernel of one whole run (torch.profiler, CUDA
activity only, graph replays included) summed by category, next to the run's wall time and the
bandwidth floor of its weight and KV reads. A diagnosis tool for the throughput work (benchmarks/NOTES.md),
not a target: the profiler adds some host overhead, so the wall time here is not the headline figure.

    python benchmarks/workload_profile.py --shape qwen3-0.6b [--kv-cache-dtype fp8]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from common import print_table, save
from shapes import CHECKPOINT_FREE, SHAPES, make_model_dir, workload

from pagednb import LLM, SamplingParams

# first matching substring of a kernel's name decides its category
CATEGORIES = [
    ("MoE routing", ("moe_select", "moe_route")),
    ("MoE expert GEMMs", ("moe_gemm",)),
    ("MoE combine", ("moe_combine",)),
    ("attention (decode rows)", ("row_attn", "group_mma")),
    ("attention (prefill)", ("prefill_attn", "prefill_kernel")),
    ("GEMM (cuBLAS)", ("nvjet", "gemm", "cutlass", "sm90_xmma", "splitKreduce")),
    ("GEMV", ("gemv",)),
    ("norms", ("rms_norm",)),
    ("q/k norm + rope + cache write", ("qk_norm_rope", "rope")),
    ("activation", ("silu", "gelu", "gate_and_mul")),
    ("cache write", ("write_kv",)),
    ("sampling", ("sample_", "argmax", "softmax", "cumsum", "sort", "topk")),
    ("copies", ("Memcpy", "copy", "Memset")),
]


def category(name: str) -> str:
    for label, keys in CATEGORIES:
        if any(k in name for k in keys):
            return label
    return "other elementwise / torch"


def profile_pass(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, dict, dict]:
    """One profiled generate: (wall s, GPU s by category, GPU s by kernel)."""
    cuda = torch.cuda.is_available()  # a CPU run (the smoke shape) profiles CPU ops instead
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize() if cuda else None
        wall = time.perf_counter() - t0
    totals: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us <= 0:
            continue
        totals[category(e.key)] += us / 1e6
        kernels[e.key] += us / 1e6
    return wall, totals, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--kv-cache-dtype", default=None)
    parser.add_argument("--prefill-pass", action="store_true",
                        help="also profile the same prompts with one output token each: the prefill steps' share "
                             "(the decode steps' is the difference)")
    args = parser.parse_args()
    prompts, outputs = workload(args.requests, SHAPES[args.shape]["vocab_size"])
    options = {} if args.kv_cache_dtype is None else {"kv_cache_dtype": args.kv_cache_dtype}
    if args.shape in CHECKPOINT_FREE:  # its folder has no weights: random ones made on the device
        options["load_format"] = "dummy"
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_model_dir(args.shape, Path(tmp) / args.shape)), max_model_len=2048, max_num_seqs=256,
                  max_num_batched_tokens=8192, **options)
        params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs]
        vocab = SHAPES[args.shape]["vocab_size"]
        # each pass gets its own token ids, so no pass finds another's prompts in the prefix cache
        shifted = [[[(t + k) % vocab for t in p] for p in prompts] for k in (1, 2, 3)]
        llm.generate(shifted[0], params, use_tqdm=False)  # warm (first-run costs, NOTES "session 4")
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        plain_wall = time.perf_counter() - t0
        wall, totals, kernels = profile_pass(llm, shifted[1], params)
        prefill = None
        if args.prefill_pass:
            one = [SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True) for _ in outputs]
            prefill = profile_pass(llm, shifted[2], one)
        steps = llm.stats()["steps"]
        llm.close()
    busy = sum(totals.values())
    print(f"\n{args.shape}, {sum(outputs)} output tokens: wall {plain_wall:.3f} s without the profiler "
          f"({sum(outputs) / plain_wall:,.0f} tok/s), {wall:.3f} s with it; {steps} engine steps in all runs")
    result = {"shape": args.shape, "wall_s_plain": plain_wall, "wall_s_profiled": wall, "categories_s": dict(totals)}
    if prefill is None:
        rows = [[k, v, v / wall * 100] for k, v in sorted(totals.items(), key=lambda kv: -kv[1])]
        rows.append(["all kernels (GPU busy)", busy, busy / wall * 100])
        rows.append(["idle (wall - busy)", wall - busy, (wall - busy) / wall * 100])
        print_table(["category", "GPU s", "% of profiled wall"], rows)
    else:
        p_wall, p_totals, _ = prefill
        p_busy = sum(p_totals.values())
        rows = [[k, v, p_totals.get(k, 0.0), v - p_totals.get(k, 0.0)]
                for k, v in sorted(totals.items(), key=lambda kv: -kv[1])]
        rows.append(["all kernels (GPU busy)", busy, p_busy, busy - p_busy])
        rows.append(["idle (wall - busy)", wall - busy, p_wall - p_busy, wall - busy - (p_wall - p_busy)])
        print(f"prefill pass (one output token each): {p_wall:.3f} s with the profiler")
        print_table(["category", "whole run GPU s", "prefill pass GPU s", "difference (decode) GPU s"], rows)
        result.update(prefill_wall_s_profiled=p_wall, prefill_categories_s=dict(p_totals))
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    print("\nTop kernels")
    print_table(["kernel", "GPU s"], [[k[:90], v] for k, v in top])
    result["top_kernels_s"] = dict(top)
    save(f"workload_profile_{args.shape}" + (f"_{args.kv_cache_dtype}" if args.kv_cache_dtype else ""), result)


if __name__ == "__main__":
    main()
