"""Where a step's time goes: host work vs GPU time per step, for prefill and decode steps at several
batch sizes, plus the top kernels of a few decode steps (torch.profiler). A diagnosis tool for the
throughput work (benchmarks/NOTES.md), not a target.

    python benchmarks/step_profile.py --shape qwen3-0.6b [--batches 1,64,256] [--eager]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import print_table, recorded_steps, save, timed_calls
from shapes import SHAPES, make_model_dir

from pagednb import LLM, RequestOutputKind, SamplingParams


def timed_steps(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Runs the requests to completion one engine step at a time, recording each step."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"p{time.perf_counter_ns()}-{i}", p, SamplingParams(
            temperature=0.6, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY))
    with recorded_steps(llm) as steps:
        while engine.has_unfinished_requests():
            engine.step()
    return steps


def summarize(name: str, steps: list[dict]) -> list:
    med = {k: statistics.median(s[k] for s in steps) for k in ("wall_ms", "runner_ms", "gpu_ms")}
    return [name, len(steps), steps[0]["rows"], med["wall_ms"], med["runner_ms"], med["gpu_ms"],
            med["wall_ms"] - med["gpu_ms"]]


def host_phases(llm: LLM, batch: int, context: int, vocab: int) -> dict:
    """Median host ms per decode step in each phase of the engine's work (a call that waits for the GPU
    shows up as a long phase)."""
    import pagednb.engine.model_runner as model_runner
    engine, runner = llm.engine, llm.engine.runner
    targets = [(engine.scheduler, "schedule"), (engine.scheduler, "update_from_output"), (runner, "launch"),
               (runner, "collect"), (runner, "_fill_decode"), (runner, "_gather_pending"), (runner.buffers, "views"),
               (runner.buffers, "upload"), (runner.stager, "next_step"), (runner.sampler, "forward"),
               (engine.output_processor, "process"),
               (model_runner.SamplingMetadata, "build")]
    if runner.graphs is not None:
        targets.append((runner.graphs, "replay"))
    targets = [(obj, name, f"{obj.__name__ if isinstance(obj, type) else type(obj).__name__}.{name}")
               for obj, name in targets]
    for i in range(batch):
        engine.add_request(f"phase{batch}-{i}", [(19 * i + j) % vocab for j in range(context)],
                           SamplingParams(temperature=0.6, max_tokens=40, ignore_eos=True,
                                          output_kind=RequestOutputKind.FINAL_ONLY))
    while any(r.num_output_tokens < 4 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    steps = []
    with timed_calls(targets) as times:
        for _ in range(25):
            t0 = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - t0) * 1e3)
    while engine.has_unfinished_requests():
        engine.step()
    result = {k: statistics.median(v) * 1e3 for k, v in times.items() if v}
    result["engine.step"] = statistics.median(steps)
    return result


def profile_decode(llm: LLM, batch: int, context: int, vocab: int) -> str:
    """torch.profiler's kernel table over 5 steady decode steps at this batch size."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"prof{batch}-{i}", [(17 * i + j) % vocab for j in range(context)],
                           SamplingParams(temperature=0.6, max_tokens=24, ignore_eos=True))
    while any(r.num_output_tokens < 8 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
    while engine.has_unfinished_requests():
        engine.step()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of each decode request")
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    vocab = SHAPES[args.shape]["vocab_size"]
    rows, result = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args.shape, Path(tmp) / args.shape)
        llm = LLM(str(model_dir), max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192,
                  enforce_eager=args.eager, enable_prefix_caching=False)
        llm.generate([[1] * 64], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        prefill = timed_steps(llm, [[(7 * i + j) % vocab for j in range(1024)] for i in range(32)], 1)
        prefill = [s for s in prefill if not s["decode"]]
        rows.append(summarize("prefill 8192-token steps", prefill))
        result["prefill"] = rows[-1]
        for batch in map(int, args.batches.split(",")):
            prompts = [[(13 * i + j) % vocab for j in range(args.context)] for i in range(batch)]
            steps = [s for s in timed_steps(llm, prompts, 64) if s["decode"]]
            rows.append(summarize(f"decode batch {batch}, context {args.context}", steps))
            result[f"decode_{batch}"] = rows[-1]
        phases = {b: host_phases(llm, b, args.context, vocab) for b in sorted({1, max(map(int, args.batches.split(",")))})}
        tables = {}
        for batch in sorted({1, max(map(int, args.batches.split(",")))}):
            tables[batch] = profile_decode(llm, batch, args.context, vocab)
        llm.close()
    for batch, table in tables.items():
        print(f"\nTop kernels of 5 decode steps at batch {batch} (context {args.context}+):")
        print(table)
    save(f"step_profile_{args.shape}" + ("_eager" if args.eager else ""), {"rows": rows, "profiles": tables,
                                                                           "host_phases_ms": phases})
    print("\nHost ms per decode step by phase (medians; nested phases overlap)")
    names = sorted({k for v in phases.values() for k in v})
    print_table(["phase"] + [f"batch {b}" for b in phases], [[n] + [phases[b].get(n, float("nan")) for b in phases] for n in names])
    print(f"\nPer-step medians ({'eager' if args.eager else 'CUDA graphs for decode'}); host = wall - GPU")
    print_table(["steps", "count", "rows", "wall ms", "runner ms", "GPU ms", "host ms"], rows)


if __name__ == "__main__":
    main()
