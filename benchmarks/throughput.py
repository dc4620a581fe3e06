"""Offline throughput on the standard workload (nano-vllm's bench, ../shared/anchors): 256 requests,
prompt and output lengths uniform in [100, 1024], random token ids, seed 0, temperature 0.6, EOS
ignored; throughput = output tokens / wall time (prefill included). Random bf16 weights of the
Qwen3-0.6B, Llama-3.2-1B or Qwen3-30B-A3B (MoE) shape (the cost does not depend on the values; nothing is
downloaded). Qwen3-30B-A3B (~61 GB) is not written to disk: both engines make random weights on the GPU
(pagednb's load_format="dummy"), HF first, freed before pagednb starts.

In the same run, on the same weights, HF transformers: continuous batching (`init_continuous_batching`)
and static `generate` in batches of 64 (greedy, as in the anchors: HF's cost does not depend on it).
HF takes ~4 minutes per method on the whole workload, so `--hf-requests N` runs it on the first N
requests (one static batch at 64) and pagednb on that same subset too, for a like-for-like ratio.

Tensor parallelism: `--tp 2` runs pagednb over 2 GPUs; `--tp 1,2` runs it at each size in turn (one
engine closed before the next starts) and reports each one's scaling over the first. A size needing
more GPUs than the machine has stops the script with the count.

    python benchmarks/throughput.py --shape qwen3-0.6b [--hf cb,static] [--hf-requests 64] [--eager]
    python benchmarks/throughput.py --shape llama-3.1-8b --tp 1,2
"""
from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import torch
from common import print_table, recorded_steps, save, step_breakdown
from shapes import CHECKPOINT_FREE, SHAPES, hf_model, make_model_dir, workload

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU only runs the tiny smoke shape


def run_pagednb(model_dir: Path, prompts, outputs, args, tp: int = 1) -> dict:
    from pagednb import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(model_dir), max_model_len=2048, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.9,
              enforce_eager=args.eager, load_format="dummy" if args.shape in CHECKPOINT_FREE else "auto",
              tensor_parallel_size=tp, kv_cache_dtype=args.kv_cache_dtype)
    startup = time.perf_counter() - t0
    llm.generate([p[:32] for p in prompts[:8]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    results = {"tensor_parallel_size": tp, "startup_s": startup, "cuda_graphs": llm.engine.uses_cuda_graphs}
    subsets = {"all": len(prompts)}
    if args.hf and args.hf_requests < len(prompts):
        subsets[f"first_{args.hf_requests}"] = args.hf_requests
    for name, n in subsets.items():
        params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs[:n]]
        before = llm.stats()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:n], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        assert produced == sum(outputs[:n])
        stats = llm.stats()
        results[name] = {"requests": n, "wall_s": wall, "output_tok_per_s": produced / wall,
                         "total_tok_per_s": (produced + sum(map(len, prompts[:n]))) / wall,
                         "steps": stats["steps"] - before["steps"],
                         "preemptions": stats["preemptions"] - before["preemptions"], "kv_blocks": stats["num_blocks"]}
    if args.breakdown:  # once more, with every step timed (adds a sync per step; not the headline figure)
        params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs]
        with recorded_steps(llm) as steps:
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            results["breakdown"] = {"wall_s": time.perf_counter() - t0, **step_breakdown(steps)}
    llm.close()
    return results


def run_hf_continuous_batching(model_dir: Path, prompts, outputs) -> dict:
    from transformers import GenerationConfig

    model = hf_model(model_dir, DEVICE)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(outputs), eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        manager.add_request(p, request_id=f"r{i}", max_new_tokens=o)
    finished, produced = 0, 0
    while finished < len(prompts) and time.perf_counter() - t0 < 600:
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            finished += 1
            produced += len(result.generated_tokens)
    wall = time.perf_counter() - t0
    manager.stop(block=True, timeout=30)
    del manager, model
    release_hf_memory()
    return {"requests": len(prompts), "finished": finished, "wall_s": wall, "output_tok_per_s": produced / wall}


def release_hf_memory() -> None:
    """HF's model (and its cache) back to the device before pagednb sizes its KV pool: reference cycles
    would keep Qwen3-30B-A3B's ~61 GB alive until a collection, so collect now; say what stays allocated."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"after HF: {torch.cuda.memory_allocated() / 2**30:.1f} GiB still allocated", flush=True)


def run_hf_static(model_dir: Path, prompts, outputs, batch: int = 64) -> dict:
    """Left-padded batches of 64 in workload order, each generating its longest request's length; only
    the tokens each request asked for count."""
    model = hf_model(model_dir, DEVICE)
    t0, useful = time.perf_counter(), 0
    for b in range(0, len(prompts), batch):
        group = range(b, min(b + batch, len(prompts)))
        width = max(len(prompts[i]) for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, i in enumerate(group):
            ids[j, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[j, width - len(prompts[i]):] = 1
        longest = max(outputs[i] for i in group)
        with torch.no_grad():
            model.generate(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=0)
        useful += sum(outputs[i] for i in group)
    wall = time.perf_counter() - t0
    del model
    release_hf_memory()
    return {"requests": len(prompts), "batch": batch, "wall_s": wall, "output_tok_per_s": useful / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True: no CUDA graphs")
    parser.add_argument("--breakdown", action="store_true", help="a second pagednb run with each step timed")
    parser.add_argument("--hf", default="", help="HF baselines to run in the same process: cb, static or cb,static")
    parser.add_argument("--hf-requests", type=int, default=256, help="run HF on the first N requests only")
    parser.add_argument("--tp", default="1", help="tensor_parallel_size, or several (1,2): each run in turn")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                        help="LLM(kv_cache_dtype=...): 'fp8' stores K/V as float8 e4m3 (twice the tokens)")
    args = parser.parse_args()
    sizes = [int(n) for n in args.tp.split(",")]
    if torch.cuda.is_available() and max(sizes) > torch.cuda.device_count():  # (a CPU runs ranks as processes)
        raise SystemExit(f"--tp {args.tp} needs {max(sizes)} GPUs; this machine has {torch.cuda.device_count()}")
    prompts, outputs = workload(args.requests, SHAPES[args.shape]["vocab_size"])
    hf_n = min(args.hf_requests, args.requests)
    baselines = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args.shape, Path(tmp) / args.shape)
        hf_first = args.shape in CHECKPOINT_FREE  # HF's random copy freed before pagednb makes its own
        runs = {} if hf_first else {tp: run_pagednb(model_dir, prompts, outputs, args, tp) for tp in sizes}
        methods = [m for m in args.hf.split(",") if m]
        if "cb" in methods:
            baselines["hf_continuous_batching"] = run_hf_continuous_batching(model_dir, prompts[:hf_n], outputs[:hf_n])
        if "static" in methods:
            baselines["hf_static_generate"] = run_hf_static(model_dir, prompts[:hf_n], outputs[:hf_n])
        if hf_first:
            runs = {tp: run_pagednb(model_dir, prompts, outputs, args, tp) for tp in sizes}
    ours = runs[sizes[0]]
    subset = "all" if hf_n == args.requests else f"first_{hf_n}"
    rows = []
    fp8 = "" if args.kv_cache_dtype == "auto" else " (fp8 KV)"
    for tp, run in runs.items():
        scaling = run["all"]["output_tok_per_s"] / ours["all"]["output_tok_per_s"]
        run["scaling_vs_first"] = scaling
        rows.append(["pagednb" + (" (eager)" if args.eager else "") + fp8 + (f" TP={tp}" if tp > 1 or len(sizes) > 1 else ""),
                     args.shape, run["all"]["requests"], sum(outputs), run["all"]["wall_s"],
                     run["all"]["output_tok_per_s"], f"{scaling:.2f}x TP={sizes[0]}" if tp != sizes[0] else "",
                     run["all"]["steps"]])
    if subset != "all":
        r = ours[subset]
        rows.append(["pagednb", args.shape, r["requests"], sum(outputs[:hf_n]), r["wall_s"], r["output_tok_per_s"],
                     "", r["steps"]])
    for name, r in baselines.items():
        ratio = ours[subset]["output_tok_per_s"] / r["output_tok_per_s"]
        r["pagednb_speedup"] = ratio
        rows.append([name, args.shape, r["requests"], sum(outputs[:hf_n]), r["wall_s"], r["output_tok_per_s"],
                     f"pagednb {ratio:.1f}x", ""])
    path = save(f"throughput_{args.shape}" + ("_eager" if args.eager else "")
                + ("" if args.kv_cache_dtype == "auto" else f"_kv_{args.kv_cache_dtype}")
                + (f"_tp{'_'.join(map(str, sizes))}" if sizes != [1] else ""),
                {"shape": args.shape, "kv_cache_dtype": args.kv_cache_dtype, "requests": args.requests,
                 "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outputs), "pagednb": ours,
                 **({f"pagednb_tp{tp}": run for tp, run in runs.items()} if sizes != [1] else {}), **baselines})
    print(f"\nThroughput, {args.requests} requests, {sum(map(len, prompts))} prompt + {sum(outputs)} output tokens; "
          f"startup {ours['startup_s']:.1f} s, CUDA graphs {'on' if ours['cuda_graphs'] else 'off'}")
    print(f"wrote {path}")
    print_table(["engine", "shape", "requests", "output tokens", "wall s", "output tok/s", "vs HF / scaling", "steps"],
                rows)
    if "breakdown" in ours:
        b = ours["breakdown"]
        print(f"\nStep breakdown (a second run, each step timed: {b['wall_s']:.2f} s)")
        print_table(["steps", "count", "mean rows", "wall s", "GPU s", "host s"],
                    [[k, v["steps"], v["mean_rows"], v["wall_s"], v["gpu_s"], v["host_s"]]
                     for k, v in b.items() if isinstance(v, dict)])


if __name__ == "__main__":
    main()
