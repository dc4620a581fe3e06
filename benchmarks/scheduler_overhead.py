"""CPU time per engine step spent outside the model, with 256 running requests.

Splits each decode step into: schedule (scheduler + KV cache manager), build inputs (flatten tokens,
positions, slot mapping, block tables), model + sampler (excluded from the target), and process
outputs (append tokens, stop checks, detokenize, build RequestOutputs). The model is the tiny test
model, so the non-model parts are what a GPU would leave on the CPU's critical path.

    python benchmarks/scheduler_overhead.py [--requests 256] [--steps 200]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import print_table, save, timed_calls  # noqa: E402
from tiny import make_tiny_model  # noqa: E402

import torch  # noqa: E402

from pagednb import LLM, RequestOutputKind, SamplingParams  # noqa: E402


class StubModel(torch.nn.Module):
    """Stands in for the model once prefill is done: on a GPU the forward runs asynchronously, so
    the CPU's share of a step is the engine's own work, which this isolates from the CPU model's
    cache and core contention."""

    def __init__(self, real):
        super().__init__()
        self.spec = real.spec

    def forward(self, input_ids, positions, kv_caches, metadata):
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.spec.vocab_size)


class StepTimer:
    """Splits each step's time by the engine's stages (timed calls), without changing the engine."""

    def __init__(self, engine, calls: dict[str, list[float]]):
        self.engine, self.calls = engine, calls
        self.samples: dict[str, list[float]] = {"schedule": [], "build_inputs": [], "model_and_sampler": [],
                                                "process_outputs": [], "step_total": []}

    def step(self):
        t0 = time.perf_counter()
        outs = self.engine.step()
        total = time.perf_counter() - t0
        calls = self.calls
        execute = calls["launch"][-1] + calls["collect"][-1]  # a CPU step is synchronous
        schedule, build = calls["schedule"][-1], calls["build_inputs"][-1]
        for key, value in (("schedule", schedule), ("build_inputs", build), ("step_total", total),
                           ("model_and_sampler", execute - build), ("process_outputs", total - execute - schedule)):
            self.samples[key].append(value)
        return outs


def run(output_kind: RequestOutputKind, num_requests: int, steps: int, model_dir: Path, stub: bool) -> dict:
    llm = LLM(str(model_dir), max_num_seqs=num_requests, max_model_len=512, num_kv_blocks=num_requests * 24)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=min(steps + 50, 350), ignore_eos=True, output_kind=output_kind)
    for i in range(num_requests):
        engine.add_request(None, [3 + (i * 7 + j) % 300 for j in range(100 + i % 37)], params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()  # prefill everyone first: the benchmark measures steady decode
    assert len(engine.scheduler.running) == num_requests
    if stub:
        engine.runner.model = StubModel(engine.runner.model)
    targets = [(engine.scheduler, "schedule", "schedule"), (engine.runner, "prepare_inputs", "build_inputs"),
               (engine.runner, "launch", "launch"), (engine.runner, "collect", "collect")]
    with timed_calls(targets) as calls:
        timer = StepTimer(engine, calls)
        for _ in range(steps):
            timer.step()
    llm.close()
    med = {k: statistics.median(v) * 1e3 for k, v in timer.samples.items()}
    med["outside_model"] = med["schedule"] + med["build_inputs"] + med["process_outputs"]
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", "llama")
        results = {f"{kind.name}, {model}": run(kind, args.requests, args.steps, model_dir, model == "stub model")
                   for model in ("stub model", "tiny CPU model")
                   for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE)}
    columns = ["schedule", "build_inputs", "process_outputs", "outside_model", "model_and_sampler", "step_total"]
    print(f"\nMedian ms per decode step, {args.requests} running requests, {args.steps} steps (target: outside_model < 1 ms)")
    print("FINAL_ONLY = LLM.generate (text decoded once at the end); CUMULATIVE = every token streamed and detokenized")
    print_table(["output kind, model"] + columns, [[kind] + [r[c] for c in columns] for kind, r in results.items()])
    path = save("scheduler_overhead", {"requests": args.requests, "steps": args.steps, "median_ms": results,
                                       "target_ms_outside_model": 1.0})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
