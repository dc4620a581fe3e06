"""Shared helpers for the benchmark scripts: environment facts and writing the JSON result."""
from __future__ import annotations

import contextlib
import datetime
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
    }


def save(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **result}, indent=1) + "\n")
    return path


def capture_graph(calls) -> torch.cuda.CUDAGraph:
    """One CUDA graph of the calls in order, after a warm-up of each on a side stream (as torch asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median ms of one replay of graph (after one untimed replay), from events between consecutive replays."""
    graph.replay()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    events[0].record()
    for i in range(reps):
        graph.replay()
        events[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(reps))


def time_ms(fns, reps: int, graph: bool = True) -> float:
    """Median ms of one call, over CUDA-graph replays of fns (rotating); graph=False: eager calls."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    calls = []
    try:
        if not graph:
            raise RuntimeError("eager timing asked for")
        calls = [capture_graph([f]).replay for f in fns]
    except Exception as exc:  # noqa: BLE001
        if graph:
            print(f"  (graph capture failed: {exc!r}; timing eager calls)")
        calls = list(fns)
    for c in calls:
        c()
    torch.cuda.synchronize()
    n = reps * len(calls)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for i in range(n):
        calls[i % len(calls)]()
        events[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(n))


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for j, row in enumerate(cells):
        print(" | ".join(c.rjust(w) for c, w in zip(row, widths)))
        if j == 0:
            print("-+-".join("-" * w for w in widths))


@contextlib.contextmanager
def timed_calls(targets: list[tuple[object, str, str]]):
    """While active, every call of obj.name (for each (obj, name, label)) appends its duration in
    seconds to times[label]; yields times. The methods are put back afterwards."""
    times: dict[str, list[float]] = {label: [] for _, _, label in targets}
    saved = []
    for obj, name, label in targets:
        inner = getattr(obj, name)
        saved.append((obj, name, vars(obj).get(name)))  # None: the attribute lives on the class

        def timed(*args, _inner=inner, _samples=times[label], **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                _samples.append(time.perf_counter() - t0)
        setattr(obj, name, timed)
    try:
        yield times
    finally:
        for obj, name, raw in reversed(saved):
            if raw is None:
                delattr(obj, name)
            else:
                setattr(obj, name, raw)


@contextlib.contextmanager
def recorded_steps(llm):
    """Records every launched step while active: rows, tokens, whether it was all decode, and GPU ms
    between events around its launch (recorded when queued, read when it is collected), plus the
    wall ms of each engine step. The reads add a wait per step, so a run measured this way is a
    diagnosis, not the headline figure."""
    engine, runner = llm.engine, llm.engine.runner
    real_step, real_launch, real_collect = engine.step, runner.launch, runner.collect
    steps: list[dict] = []
    cuda = torch.cuda.is_available()

    def launch(sched, *args, **kwargs):
        info = {"rows": len(sched.scheduled), "tokens": sched.num_scheduled_tokens,
                "decode": all(s.num_new_tokens == 1 for s in sched.scheduled), "t0": time.perf_counter()}
        if cuda:
            info["start"], info["end"] = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            info["start"].record()
        launched = real_launch(sched, *args, **kwargs)
        if cuda:
            info["end"].record()
        launched.info = info
        return launched

    def collect(launched):
        out = real_collect(launched)
        info = launched.info
        info["runner_ms"] = (time.perf_counter() - info.pop("t0")) * 1e3
        if cuda:
            start, end = info.pop("start"), info.pop("end")
            end.synchronize()
            info["gpu_ms"] = start.elapsed_time(end)
        else:
            info["gpu_ms"] = info["runner_ms"]
        steps.append(info)
        return out

    def step():
        t0 = time.perf_counter()
        n = len(steps)
        outs = real_step()
        for info in steps[n:]:
            info["wall_ms"] = (time.perf_counter() - t0) * 1e3
        return outs

    engine.step, runner.launch, runner.collect = step, launch, collect
    try:
        yield steps
    finally:
        engine.step, runner.launch, runner.collect = real_step, real_launch, real_collect


def step_breakdown(steps: list[dict]) -> dict:
    """Sums of wall / GPU / host (wall - GPU) seconds for decode-only steps and for the others. With
    asynchronous scheduling a step's host work overlaps another's GPU time, so host_s is only the
    part left on the critical path (wall of the engine steps that finished these steps minus GPU)."""
    out = {}
    for kind, chosen in (("decode", [s for s in steps if s["decode"]]), ("prefill_or_mixed", [s for s in steps if not s["decode"]])):
        wall = sum(s["wall_ms"] for s in chosen) / 1e3
        gpu = sum(s["gpu_ms"] for s in chosen) / 1e3
        out[kind] = {"steps": len(chosen), "wall_s": wall, "gpu_s": gpu, "host_s": wall - gpu,
                     "mean_rows": sum(s["rows"] for s in chosen) / max(len(chosen), 1)}
    return out
