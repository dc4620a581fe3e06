"""Cancel latency: time from `llm.abort()` to the end of the stream, and the blocks given back, with
engine steps of known length (each model step sleeps a fixed time on top of the embedded model).
Target: within one step plus 50 ms.

    python benchmarks/cancel_latency.py
"""
from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time

from common import print_table, save

from pagednb import LLM, SamplingParams

STEP_MS = (0, 20, 50, 100)
STEPS: StepLog
TRIALS = 10


class StepLog:
    """Records each engine step's start and end, so each abort is judged against the step it hit."""

    def __init__(self, llm: LLM):
        self.spans: list[tuple[float, float]] = []
        engine, real = llm.engine, llm.engine.step

        def step():
            start = time.perf_counter()
            try:
                return real()
            finally:
                self.spans.append((start, time.perf_counter()))
        engine.step = step

    def step_in_flight(self, t: float) -> float:
        """Length of the step running at time t (the last one, if t fell between steps)."""
        for start, end in reversed(self.spans):
            if start <= t:
                return end - start if t <= end else 0.0
        return 0.0


def slow_down(llm: LLM, step_ms: float) -> None:
    runner = llm.engine.runner  # the runner's step, not the model's forward: a GPU decode step replays a graph
    real = runner.launch.__wrapped__ if hasattr(runner.launch, "__wrapped__") else runner.launch

    def launch(*args, **kwargs):
        time.sleep(step_ms / 1e3)
        return real(*args, **kwargs)
    launch.__wrapped__ = real
    runner.launch = launch


async def one_trial(llm: LLM, from_thread: bool, trial: int, step_ms: float) -> dict:
    """Aborts after 10 tokens: from the loop right after an output (between steps), or from another
    thread at a random moment within the next step and a half (usually mid-step: the worst case)."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    request_id = f"cancel-{from_thread}-{trial}"
    marks: dict[str, float] = {}

    def abort_now():
        marks["abort_at"] = time.perf_counter()
        llm.abort(request_id)
    async for out in llm.stream("Tell me a story about a cat named Tom.", params, request_id=request_id):
        if "used_before" not in marks and len(out.outputs[0].token_ids) == 10:
            marks["used_before"] = llm.stats()["used_blocks"]
            if from_thread:
                threading.Timer(random.uniform(0, 1.5 * step_ms) / 1e3, abort_now).start()
            else:
                abort_now()
    ended = time.perf_counter()
    assert out.outputs[0].finish_reason == "abort"
    hit = STEPS.step_in_flight(marks["abort_at"]) * 1e3
    return {"latency_ms": (ended - marks["abort_at"]) * 1e3, "step_in_flight_ms": hit, "target_ms": hit + 50,
            "used_after": llm.stats()["used_blocks"],
            "blocks_freed": marks["used_before"] - llm.stats()["used_blocks"]}


def main() -> None:
    global STEPS
    random.seed(0)
    llm = LLM(num_kv_blocks=512)
    STEPS = StepLog(llm)
    rows, results = [], {}
    for step_ms in STEP_MS:
        slow_down(llm, step_ms)
        t0, steps0 = time.perf_counter(), llm.driver.num_steps
        llm.generate("warm up", SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
        measured_step_ms = (time.perf_counter() - t0) / (llm.driver.num_steps - steps0) * 1e3
        for from_thread in (False, True):
            trials = [asyncio.run(one_trial(llm, from_thread, t, measured_step_ms)) for t in range(TRIALS)]
            latency = statistics.median(t["latency_ms"] for t in trials)
            worst = max(t["latency_ms"] for t in trials)
            key = f"step_{step_ms}ms_{'thread' if from_thread else 'loop'}"
            results[key] = {"step_ms": measured_step_ms, "trials": trials, "median_latency_ms": latency,
                            "max_latency_ms": worst}
            met = all(t["latency_ms"] <= t["target_ms"] for t in trials)
            rows.append([f"{measured_step_ms:.1f}", "thread, mid-step" if from_thread else "loop, between steps", latency,
                         worst, max(t["step_in_flight_ms"] for t in trials), min(t["blocks_freed"] for t in trials),
                         max(t["used_after"] for t in trials), "yes" if met else "NO"])
    llm.close()
    print(f"\nabort() -> stream end, embedded model, {TRIALS} trials each")
    print("target: each abort ends its stream within the step it landed in plus 50 ms")
    print_table(["step ms", "abort from", "median ms", "max ms", "longest step hit ms", "blocks freed", "used after",
                 "met"], rows)
    print(f"wrote {save('cancel_latency', {'results': results})}")


if __name__ == "__main__":
    main()
