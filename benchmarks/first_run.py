"""Is a process's first pass over the throughput workload slower than its later ones, and where?
A diagnosis tool for the throughput work (benchmarks/NOTES.md), not a target.

Runs the standard workload (benchmarks/shapes.py) several times in one engine, each pass with other token
ids (same lengths, so the prefix cache finds nothing), and prints each pass's wall time. With --steps,
every step is timed (a wait per step: slower overall, but the passes compare like for like) and the steps
whose time differs most between the first and the last pass are listed, as GPU or host time.

    python benchmarks/first_run.py --shape llama-3.2-1b [--passes 3] [--steps] [--gc default|freeze|off]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import tempfile
import time
from pathlib import Path

import torch
from common import print_table, recorded_steps, save
from shapes import SHAPES, make_model_dir, workload

from pagednb import LLM, SamplingParams


@contextlib.contextmanager
def gc_pauses():
    """Yields a list that collects (generation, seconds) for every garbage collection while active."""
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))
    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def one_pass(llm: LLM, prompts: list[list[int]], outputs: list[int], shift: int, vocab: int) -> float:
    shifted = [[(t + shift) % vocab for t in p] for p in prompts]
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(shifted, params, use_tqdm=False)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--steps", action="store_true", help="time every step of the first and last pass")
    parser.add_argument("--gc", choices=["default", "freeze", "off"], default="default",
                        help="freeze: gc.collect() + gc.freeze() before the passes; off: gc.disable() during them")
    args = parser.parse_args()
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts, outputs = workload(256, vocab)
    walls, recorded = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args.shape, Path(tmp) / args.shape)
        llm = LLM(str(model_dir), max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192,
                  gpu_memory_utilization=0.9)
        llm.generate([p[:32] for p in prompts[:8]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        if args.gc == "freeze":
            gc.collect()
            gc.freeze()
        elif args.gc == "off":
            gc.disable()
        pauses = []
        for i in range(args.passes):
            with gc_pauses() as pass_pauses, (recorded_steps(llm) if args.steps and i in (0, args.passes - 1)
                                               else contextlib.nullcontext()) as steps:
                walls.append(one_pass(llm, prompts, outputs, i + 1, vocab))
            if steps is not None:
                recorded.append(steps)
            pauses.append(pass_pauses)
            print(f"pass {i + 1}: {walls[-1]:.3f} s, {sum(outputs) / walls[-1]:,.0f} output tok/s; garbage collections "
                  f"(gen 0/1/2): {[sum(1 for g, _ in pass_pauses if g == k) for k in range(3)]}, "
                  f"{1e3 * sum(t for _, t in pass_pauses):.1f} ms in all, longest "
                  f"{1e3 * max((t for _, t in pass_pauses), default=0):.1f} ms", flush=True)
        gc.enable()
        llm.close()
    result = {"shape": args.shape, "gc": args.gc, "passes_s": walls,
              "gc_pauses": [[(g, 1e3 * t) for g, t in p] for p in pauses]}
    if recorded:
        first, last = recorded[0], recorded[-1]
        rows = []
        for k, (a, b) in enumerate(zip(first, last)):
            rows.append([k, a["rows"], a["tokens"], a["gpu_ms"], b["gpu_ms"], a["wall_ms"], b["wall_ms"],
                         (a["wall_ms"] - b["wall_ms"])])
        result["steps"] = {"first": first, "last": last}
        worst = sorted(rows, key=lambda r: -r[-1])[:25]
        print("\nSteps slower in the first pass than in the last (by engine-step wall ms)")
        print_table(["step", "rows", "tokens", "GPU ms 1st", "GPU ms last", "wall ms 1st", "wall ms last", "diff"],
                    worst)
        for name, steps in (("first", first), ("last", last)):
            print(f"{name} pass: {len(steps)} steps, wall {sum(s['wall_ms'] for s in steps) / 1e3:.3f} s, "
                  f"GPU {sum(s['gpu_ms'] for s in steps) / 1e3:.3f} s; non-decode steps GPU "
                  f"{sum(s['gpu_ms'] for s in steps if not s['decode']) / 1e3:.3f} s")
    path = save(f"first_run_{args.shape}" + ("" if args.gc == "default" else f"_gc_{args.gc}"), result)
    print(f"wrote {path}")
    print_table(["pass", "wall s", "output tok/s"], [[i + 1, w, sum(outputs) / w] for i, w in enumerate(walls)])


if __name__ == "__main__":
    main()
