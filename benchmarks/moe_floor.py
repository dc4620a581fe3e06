"""The memory-bandwidth floor of the standard workload on the Qwen3-30B-A3B shape: how fast could any engine
run it on one H200, and so is issue 15's 8,000 output tok/s reachable at all? CPU only.

The workload goes through pagednb's real scheduler at the throughput benchmark's settings (max_num_seqs 256,
max_num_batched_tokens 8192, max_model_len 2048, the same seed-0 requests) with the model stubbed out
(scheduler_overhead.StubModel), which records every step's shape: its tokens, its sampled rows and each
row's context. Per step, what the H200 must at least do:

  * weight bytes: per MoE layer the experts the step's tokens touch (top-8 of 128, routed uniformly at
    random as the dummy weights route: E * (1 - (1 - k / E) ** tokens) of them, 3 * hidden * moe_intermediate
    bf16 each), the attention projections, router and norms of every layer, and the lm_head (all rows);
  * KV bytes: each row's whole context of K and V read once per layer, its new tokens' K and V written;
  * FLOPs: 2 per active parameter per token (lm_head: per sampled row) plus attention's QK^T and PV.

A step's floor is max(bytes / bandwidth, FLOPs / tensor-core rate); the run's floor is their sum, and
output tokens / floor is the ceiling no engine beats on this hardware at bf16. `--measured` also prices
every step's MoE layers at the fused kernel's measured times (benchmarks/results/moe.json, interpolated in
tokens) with everything else at its floor: what the kernel alone leaves of the ceiling.

    python benchmarks/moe_floor.py [--bandwidth 4.0,4.3,4.8] [--tflops 700] [--measured]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from common import RESULTS, print_table, save
from scheduler_overhead import StubModel
from shapes import SHAPES, make_model_dir, workload

from pagednb import LLM, SamplingParams

SHAPE = SHAPES["qwen3-30b-a3b"]
BF16 = 2
RUN_3886 = {"output_tok_per_s": 3886.5, "wall_s": 34.47, "steps": 1041}  # results/throughput_qwen3-30b-a3b.json


def record_steps(num_requests: int) -> tuple[list[dict], int]:
    """Every step of the standard workload as the scheduler plans it: tokens, sampled rows, and per
    scheduled request (context before the step, new tokens). Also the run's preemption count."""
    prompts, outputs = workload(num_requests, SHAPES["tiny"]["vocab_size"])
    steps: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        # the tiny shape's tokenizer and KV layout are irrelevant: only the scheduler's choices are kept;
        # a pool of max_num_seqs whole-length sequences, what the H200 run had (32,768 blocks, no preemption)
        llm = LLM(str(make_model_dir("tiny", Path(tmp) / "tiny")), max_model_len=2048, max_num_seqs=256,
                  max_num_batched_tokens=8192, num_kv_blocks=256 * 2048 // 16, enforce_eager=True)
        engine = llm.engine
        engine.runner.model = StubModel(engine.runner.model)
        schedule = engine.scheduler.schedule

        def recording_schedule():
            out = schedule()
            rows = [(s.start, s.num_new_tokens) for s in out.scheduled]
            if rows:
                steps.append({"rows": np.array(rows, dtype=np.int64),
                              "sampled": sum(s.samples for s in out.scheduled)})
            return out

        engine.scheduler.schedule = recording_schedule
        params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs]
        llm.generate(prompts, params, use_tqdm=False)
        preemptions = llm.stats()["preemptions"]
        llm.close()
    return steps, preemptions


class ShapeCosts:
    """Bytes and FLOPs of one step of the Qwen3-30B-A3B shape, from the step's rows."""

    def __init__(self, s: dict) -> None:
        h, layers, heads, kv_heads, d = (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"],
                                         s["num_key_value_heads"], s["head_dim"])
        self.layers, self.experts, self.top_k = layers, s["num_experts"], s["num_experts_per_tok"]
        self.expert_params = 3 * h * s["moe_intermediate_size"]
        attn_params = h * (heads + 2 * kv_heads) * d + heads * d * h
        self.dense_params_per_layer = attn_params + h * self.experts + 2 * h + 2 * d  # + router, norms
        self.lm_head_params = s["vocab_size"] * h
        self.kv_bytes_per_token = layers * 2 * kv_heads * d * BF16
        self.attn_flops_per_pair = layers * 4 * heads * d  # QK^T and PV, per (query, key) pair

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts per layer under uniform top-k routing (the dummy weights')."""
        return self.experts * (1 - (1 - self.top_k / self.experts) ** tokens)

    def step(self, rows: np.ndarray, sampled: int) -> dict:
        start, new = rows[:, 0], rows[:, 1]
        tokens = int(new.sum())
        expert_bytes = self.layers * self.experts_touched(tokens) * self.expert_params * BF16
        dense_bytes = (self.layers * self.dense_params_per_layer + self.lm_head_params) * BF16
        kv_bytes = float(((start + new).sum() + new.sum()) * self.kv_bytes_per_token)
        pairs = float((new * start + new * (new + 1) / 2).sum())  # causal (query, key) pairs
        active = self.layers * (self.top_k * self.expert_params + self.dense_params_per_layer)
        flops = 2.0 * tokens * active + 2.0 * sampled * self.lm_head_params + pairs * self.attn_flops_per_pair
        return {"tokens": tokens, "expert_bytes": expert_bytes, "dense_bytes": dense_bytes, "kv_bytes": kv_bytes,
                "flops": flops, "experts_touched": self.experts_touched(tokens)}


def measured_moe_ms(path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """(tokens, ms per MoE layer) of the fused kernel as last measured, or None without a result."""
    if not path.exists():
        return None
    results = json.loads(path.read_text())["results"].values()
    pts = sorted((r["tokens"], r["fused_ms"]) for r in results)
    return np.array([p[0] for p in pts], dtype=float), np.array([p[1] for p in pts])


def moe_layer_ms(moe_ms: tuple[np.ndarray, np.ndarray], tokens: int) -> float:
    """Log-log interpolation between the measured sizes; past the largest, time grows with the tokens (the
    kernel is compute-bound there: 2,048 tokens ran at 147 TFLOP/s)."""
    xs, ys = moe_ms
    if tokens > xs[-1]:
        return float(ys[-1] * tokens / xs[-1])
    return float(np.exp(np.interp(np.log(tokens), np.log(xs), np.log(ys))))


def floor_seconds(costs: list[dict], gbps: float, tflops: float, moe_ms=None, layers: int = 0) -> dict:
    """The run's floor split by what binds each step; with moe_ms, the MoE layers at measured times."""
    parts = {"expert_weights_s": 0.0, "dense_weights_s": 0.0, "kv_s": 0.0, "compute_bound_extra_s": 0.0}
    total = 0.0
    for c in costs:
        bytes_s = {"expert_weights_s": c["expert_bytes"], "dense_weights_s": c["dense_bytes"], "kv_s": c["kv_bytes"]}
        bytes_s = {k: v / (gbps * 1e9) for k, v in bytes_s.items()}
        if moe_ms is not None:
            bytes_s["expert_weights_s"] = layers * moe_layer_ms(moe_ms, c["tokens"]) / 1e3
        memory = sum(bytes_s.values())
        step = max(memory, c["flops"] / (tflops * 1e12))
        for k, v in bytes_s.items():
            parts[k] += v
        parts["compute_bound_extra_s"] += step - memory
        total += step
    return {"floor_s": total, **parts}


def step_floor_s(c: dict, bytes_per_s: float, flops_per_s: float) -> float:
    return max((c["expert_bytes"] + c["dense_bytes"] + c["kv_bytes"]) / bytes_per_s, c["flops"] / flops_per_s)


def print_run(steps: list[dict], costs: list[dict], preemptions: int, output_tokens: int) -> None:
    tokens = np.array([c["tokens"] for c in costs])
    decode = sum((s["rows"][:, 1] == 1).all() for s in steps)
    total = {k: sum(c[k] for c in costs) for k in ("expert_bytes", "dense_bytes", "kv_bytes", "flops")}
    print(f"{len(steps)} steps ({decode} decode-only, {preemptions} preemptions), {output_tokens} output tokens; "
          f"tokens per step: median {np.median(tokens):.0f}, max {tokens.max()}")
    print(f"bytes over the run: experts {total['expert_bytes'] / 1e12:.1f} TB, attention/router/lm_head "
          f"{total['dense_bytes'] / 1e12:.1f} TB, KV {total['kv_bytes'] / 1e12:.1f} TB; "
          f"{total['flops'] / 1e15:.2f} PFLOP")


def print_by_size(costs: list[dict], tb_per_s: float, tflops: float) -> None:
    sizes = (("1-63 tokens", 1, 64), ("64-255", 64, 256), ("256", 256, 257), ("257-8192 (prefill)", 257, 8193))
    rows = []
    for label, lo, hi in sizes:
        chosen = [c for c in costs if lo <= c["tokens"] < hi]
        rows.append([label, len(chosen), float(np.mean([c["experts_touched"] for c in chosen])) if chosen else 0.0,
                     sum(step_floor_s(c, tb_per_s * 1e12, tflops * 1e12) for c in chosen)])
    print(f"\nSteps by size (floor at {tb_per_s} TB/s)")
    print_table(["tokens per step", "steps", "experts touched (mean)", "floor s"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--bandwidth", default="4.0,4.3,4.8", help="HBM TB/s, comma-separated (4.8: the spec)")
    parser.add_argument("--tflops", type=float, default=700.0, help="achievable bf16 tensor-core TFLOP/s")
    parser.add_argument("--measured", action="store_true", help="also price the MoE at results/moe.json's times")
    args = parser.parse_args()
    bandwidths = [float(b) for b in args.bandwidth.split(",")]
    steps, preemptions = record_steps(args.requests)
    shape = ShapeCosts(SHAPE)
    costs = [shape.step(s["rows"], s["sampled"]) for s in steps]
    output_tokens = sum(workload(args.requests)[1])
    print_run(steps, costs, preemptions, output_tokens)
    scenarios = {f"floor at {bw} TB/s, {args.tflops:.0f} TFLOP/s": floor_seconds(costs, bw * 1e3, args.tflops)
                 for bw in bandwidths}
    moe_ms = measured_moe_ms(RESULTS / "moe.json") if args.measured else None
    if moe_ms is not None:
        scenarios[f"MoE at moe.json's kernel times, the rest at {bandwidths[1]} TB/s"] = floor_seconds(
            costs, bandwidths[1] * 1e3, args.tflops, moe_ms, shape.layers)
    for s in scenarios.values():
        s["ceiling_tok_per_s"] = output_tokens / s["floor_s"]
        s["run_3886_vs_floor"] = RUN_3886["wall_s"] / s["floor_s"]
    print_table(["scenario", "floor s", "experts s", "attn/lm_head s", "KV s", "compute extra s", "ceiling tok/s",
                 "3,886 run / floor"],
                [[k, v["floor_s"], v["expert_weights_s"], v["dense_weights_s"], v["kv_s"], v["compute_bound_extra_s"],
                  f"{v['ceiling_tok_per_s']:,.0f}", v["run_3886_vs_floor"]] for k, v in scenarios.items()])
    print_by_size(costs, bandwidths[1], args.tflops)
    path = save("moe_floor_qwen3-30b-a3b", {
        "settings": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_model_len": 2048,
                     "requests": args.requests, "tflops": args.tflops},
        "steps": len(steps), "preemptions": preemptions, "output_tokens": output_tokens,
        "scenarios": scenarios, "reference_run": RUN_3886})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
