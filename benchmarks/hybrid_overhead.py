"""Host time per decode step of a hybrid (sliding + full) model against a uniform one of the same size.

Gemma-3-1B's engine was host-bound on the H200 (benchmarks/NOTES.md, issue 15): its KV cache is split into
layer groups (engine/kv_cache_groups.py), and each group has its own block lists and block table per request.
This model isolates that cost on the CPU: a tiny 26-layer Gemma 3 (Gemma-3-1B's layer pattern:
every 6th layer full, window 512) and a tiny 26-layer Llama, both with the model stubbed out
(scheduler_overhead.StubModel: the step's forward on a GPU runs asynchronously, so the engine's own work is
what the host adds), 256 requests of the standard workload's lengths decoding, asynchronous scheduling and
prefix caching on as on the GPU. Each step is split into schedule (scheduler + KV cache manager), build
inputs (block tables, slots), the stub's model and sampler, and process outputs (outputs, prefix-cache commits);
step_mean shows the garbage collector's pauses that the median hides.

    python benchmarks/hybrid_overhead.py [--requests 256] [--steps 300] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import print_table, save, timed_calls  # noqa: E402
from scheduler_overhead import StepTimer, StubModel  # noqa: E402
from shapes import workload  # noqa: E402
from tiny import make_tiny_model  # noqa: E402

import torch  # noqa: E402

from pagednb import LLM, SamplingParams  # noqa: E402
from pagednb.engine.kv_cache_groups import KVCacheLayout, plan_kv_cache_layout  # noqa: E402

NUM_LAYERS, WINDOW, BLOCK_SIZE = 26, 512, 16
MODELS = {  # a tiny config of each: 26 layers, one KV head, the host sees only the layer pattern
    "gemma3": ("gemma3_text", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                   layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                                for i in range(NUM_LAYERS)])),
    "llama": ("llama", {}),
}


def blocks_for(layout: KVCacheLayout, num_requests: int, max_len: int) -> int:
    """A pool that never preempts: every request's full groups at max_len, its sliding groups at the window."""
    return num_requests * sum(-(-max_len // BLOCK_SIZE) if group.window is None else WINDOW // BLOCK_SIZE + 3
                              for group in layout.groups)


def run(model_dir: Path, layer_windows: tuple[int | None, ...], num_requests: int, steps: int, profile: bool
        ) -> dict:
    prompts, outputs = workload(num_requests, 300)
    max_len = max(len(p) + o for p, o in zip(prompts, outputs)) + 8
    layout = plan_kv_cache_layout(layer_windows)
    num_blocks = blocks_for(layout, num_requests, max_len)
    llm = LLM(str(model_dir), max_num_seqs=num_requests, max_model_len=max_len, num_kv_blocks=num_blocks,
              async_scheduling=True)
    engine = llm.engine
    engine.runner.model = StubModel(engine.runner.model)  # prefill as well: only the host's work is timed
    for prompt, out in zip(prompts, outputs):
        engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    targets = [(engine.scheduler, "schedule", "schedule"), (engine.runner, "prepare_inputs", "build_inputs"),
               (engine.runner, "launch", "launch"), (engine.runner, "collect", "collect")]
    profiler = cProfile.Profile() if profile else None
    with timed_calls(targets) as calls:
        timer = StepTimer(engine, calls)
        for _ in range(10):  # warm up (and let the first blocks leave the windows)
            timer.step()
        for samples in timer.samples.values():
            samples.clear()
        if profiler is not None:
            profiler.enable()
        for _ in range(steps):
            timer.step()
        if profiler is not None:
            profiler.disable()
    running = len(scheduler.running)
    llm.close()
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    result = {k: statistics.median(v) * 1e3 for k, v in timer.samples.items()}
    result["step_mean"] = statistics.fmean(timer.samples["step_total"]) * 1e3
    result["running_at_end"] = running
    result["groups"] = len(layout.groups)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions of each run")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the stub's few tensor ops: threads only add noise on a shared machine
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, overrides) in MODELS.items():
            model_dir = make_tiny_model(Path(tmp) / arch, arch, num_hidden_layers=NUM_LAYERS, hidden_size=32,
                                        intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=4096, **overrides)
            windows = tuple(WINDOW if t == "sliding_attention" else None for t in overrides.get("layer_types", ()))
            results[name] = run(model_dir, windows or (None,) * NUM_LAYERS, args.requests, args.steps, args.profile)
    columns = ["groups", "schedule", "build_inputs", "model_and_sampler", "process_outputs", "step_total", "step_mean",
               "running_at_end"]
    print(f"\nms per decode step (median; step_mean: the mean), {args.requests} requests of the standard workload's "
          f"lengths, {args.steps} steps, model stubbed")
    print_table(["model"] + columns, [[name] + [r[c] for c in columns] for name, r in results.items()])
    path = save("hybrid_overhead", {"requests": args.requests, "steps": args.steps, "ms_per_step": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
