"""The fused MoE kernel (kernels_cuda/moe.cu) on one Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts of
intermediate 768, top-8, bf16) at 1 to 8192 tokens, beside:

  * a dense GEMM of the same active FLOPs (torch F.linear: x [T, 2048] by the top-8 experts' weights laid
    side by side, [2048 -> 8 * 1536] then [8 * 768 -> 2048]). Target (issue 15): fused time within 1.5x of
    it at each size. At 256 tokens and more nearly every expert is touched, so the MoE layer must read
    ~16x the dense GEMM's weight bytes: there the honest bar is
  * the weight-bytes floor: the bytes of the experts this routing touches, read at the copy bandwidth
    measured here (read + write of a 2 GiB tensor, eager: a graph's memcpy node runs slower, NOTES issue 13);
  * the pure-torch reference (fused_moe_reference: HF's expert loop, eager, with its host syncs).

"fused" is fused_moe as the layers call it: the CUDA kernel, or from 64 rows per expert in bf16 (1,024 tokens
here) torch._grouped_mm's path (column "path"); "moe.cu" is the CUDA kernel alone at every size.
The routing (softmax, top-k, renormalisation: select_experts) is timed apart, the kernel against torch's five
launches, and with the experts as the layer runs them ("layer": router logits in, output out). Each size's
kernels are also profiled one by one (eager calls, torch.profiler): routing, sort, gate/up GEMM, down GEMM,
combine, so a miss says which launch to look at. From 256 tokens the whole torch._grouped_mm path is timed
at every size ("grouped_mm path"), to place the row count where fused_moe switches to it.

Timing: each call captured in a CUDA graph and replayed back to back, rotating over 4 routings (different
experts each time, so the L2 does not keep a call's weights for the next); one CUDA event per replay,
median. The reference is timed eagerly (it reads the routing on the host).

    python benchmarks/moe.py [--reps 50]        # table on stdout, JSON in benchmarks/results/moe.json
    PAGEDNB_PDL=0 python benchmarks/moe.py      # without programmatic dependent launch (moe_pdl_off.json);
                                                # there the profiled kernel times hold no early-start waits
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # pagednb from this checkout

from common import print_table, save, time_ms  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pagednb.model.fused_moe import (KERNEL, fused_moe, fused_moe_reference, grouped_mm_moe,  # noqa: E402
                                     grouped_mm_serves, select_experts, select_experts_reference)

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B
DT = torch.bfloat16
TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 8192)  # 64-255: most decode steps of the workload; 8192: a prefill
ROUTINGS = 4


def copy_gbps(reps: int) -> float:
    src = torch.empty(1 << 30, dtype=DT, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms([lambda: dst.copy_(src)], reps, graph=False)
    return 2 * src.numel() * src.element_size() / ms / 1e6


# stage of the layer <- the parts of a kernel's name (first match; moe_gemm_kernel<..., kGateUp, kDirect>);
# up to 16 tokens the down GEMM's last CTAs also do the combine; any other kernel (torch._grouped_mm's path) is
# "other"
STAGES = ((("moe_select",), "routing"), (("moe_route",), "sort by expert"),
          (("moe_gemm", ", true, "), "gate/up GEMM"), (("moe_gemm", ", false, "), "down GEMM"),
          (("moe_combine",), "combine"), ((), "other"))


def kernel_breakdown_ms(call, calls: int = 20) -> dict[str, float]:
    """GPU ms per call of each stage's kernels (torch.profiler over eager calls)."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        stage = next(label for keys, label in STAGES if all(k in e.key for k in keys))
        if e.self_device_time_total > 0:
            out[stage] = out.get(stage, 0.0) + e.self_device_time_total / 1e3 / calls
    return out


def grouped_mm_path_ms(hidden, w13, w2, routings, reps: int) -> float | str:
    """The whole torch._grouped_mm path (grouped_mm_moe: sort, gather, the two grouped GEMMs, put back, bmm)
    at any size, so the row count where fused_moe switches to it can be read off; the error where torch has
    no such op or refuses these operands."""
    try:
        return time_ms([lambda r=r: grouped_mm_moe(hidden, w13, w2, *r) for r in routings], reps)
    except Exception as exc:  # noqa: BLE001 - a probe: say why, carry on
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"


def bench_tokens(T: int, w13, w2, gbps: float, reps: int, gen) -> dict:
    hidden = torch.randn(T, HIDDEN, generator=gen, device="cuda").to(DT)
    logits = [torch.randn(T, EXPERTS, generator=gen, device="cuda").to(DT) for _ in range(ROUTINGS)]
    routings = [select_experts(x, TOP_K, True, True) for x in logits]
    fused_ms = time_ms([lambda r=r: fused_moe(hidden, w13, w2, *r) for r in routings], reps)
    grouped = grouped_mm_serves(hidden, w13, w2, routings[0][1])
    kernel = KERNEL.get()
    kernel_only_ms = (time_ms([lambda r=r: kernel.fused_moe(hidden, w13, w2, *r) for r in routings], reps)
                      if grouped else fused_ms)
    route_ms = time_ms([lambda x=x: select_experts(x, TOP_K, True, True) for x in logits], reps)
    route_torch_ms = time_ms([lambda x=x: select_experts_reference(x, TOP_K, True, True) for x in logits], reps)
    layer_ms = time_ms([lambda x=x: fused_moe(hidden, w13, w2, *select_experts(x, TOP_K, True, True))
                        for x in logits], reps)
    stages = kernel_breakdown_ms(lambda: fused_moe(hidden, w13, w2, *select_experts(logits[0], TOP_K, True, True)))
    grouped_path = grouped_mm_path_ms(hidden, w13, w2, routings, reps) if T >= 256 else "-"
    ref_ms = time_ms([lambda r=r: fused_moe_reference(hidden, w13, w2, *r) for r in routings],
                       max(3, reps // 10), graph=False)
    dense_mid = torch.randn(T, TOP_K * INTER, generator=gen, device="cuda").to(DT)
    dense = [(torch.randn(TOP_K * 2 * INTER, HIDDEN, generator=gen, device="cuda").to(DT),
              torch.randn(HIDDEN, TOP_K * INTER, generator=gen, device="cuda").to(DT)) for _ in range(ROUTINGS)]
    dense_ms = time_ms([lambda up=up, down=down: (F.linear(hidden, up), F.linear(dense_mid, down))
                          for up, down in dense], reps)  # 4 weight sets (38 MB each): not served from L2
    touched = statistics.mean(len(torch.unique(ids)) for _, ids in routings)
    weight_bytes = touched * 3 * HIDDEN * INTER * 2
    floor_ms = weight_bytes / gbps / 1e6
    flops = 2 * T * TOP_K * 3 * HIDDEN * INTER
    return {"tokens": T, "experts_touched": touched, "path": "torch._grouped_mm" if grouped else "moe.cu",
            "fused_ms": fused_ms, "moe_cu_ms": kernel_only_ms, "routing_ms": route_ms,
            "routing_torch_ms": route_torch_ms, "layer_ms": layer_ms, "layer_vs_dense": layer_ms / dense_ms,
            "kernel_ms": stages, "grouped_mm_path_ms": grouped_path, "dense_gemm_ms": dense_ms,
            "reference_ms": ref_ms, "weight_bytes_floor_ms": floor_ms, "fused_TFLOPs": flops / fused_ms / 1e9,
            "fused_weight_GBps": weight_bytes / fused_ms / 1e6, "vs_dense": fused_ms / dense_ms,
            "vs_floor": fused_ms / floor_ms, "vs_reference": ref_ms / fused_ms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if KERNEL.get() is None:
        from pagednb.kernels import load_error
        raise SystemExit(f"CUDA kernels unavailable: {load_error()}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device="cuda") / HIDDEN ** 0.5).to(DT)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device="cuda") / INTER ** 0.5).to(DT)
    gbps = copy_gbps(args.reps)
    print(f"copy bandwidth {gbps:,.0f} GB/s", flush=True)
    results = {}
    for T in TOKENS:
        results[f"T{T}"] = r = bench_tokens(T, w13, w2, gbps, args.reps, gen)
        print(r, flush=True)
    targets = {k: {"target": "<= 1.5x dense GEMM of the same active FLOPs", "ratio": r["vs_dense"],
                   "met": r["vs_dense"] <= 1.5,
                   "vs_weight_bytes_floor": {"target": "<= 1.5x", "ratio": r["vs_floor"], "met": r["vs_floor"] <= 1.5}}
               for k, r in results.items()}
    from pagednb.kernels import load_kernels
    pdl = bool(load_kernels().pagednb_pdl_enabled())  # PAGEDNB_PDL=0 turns it off: `moe_pdl_off.json`
    path = save("moe" if pdl else "moe_pdl_off",
                {"shape": {"hidden": HIDDEN, "moe_intermediate": INTER, "experts": EXPERTS, "top_k": TOP_K,
                           "dtype": "bfloat16"}, "programmatic_dependent_launch": pdl, "copy_GBps": gbps,
                 "results": results, "targets": targets})
    print(f"wrote {path}")
    print_table(["tokens", "experts", "path", "fused ms", "moe.cu ms", "dense ms", "x dense", "floor ms", "x floor",
                 "weight GB/s", "TFLOP/s", "ref ms", "ref / fused", "<=1.5x dense", "<=1.5x floor"],
                [[r["tokens"], r["experts_touched"], r["path"], r["fused_ms"], r["moe_cu_ms"], r["dense_gemm_ms"],
                  r["vs_dense"],
                  r["weight_bytes_floor_ms"], r["vs_floor"], r["fused_weight_GBps"], r["fused_TFLOPs"],
                  r["reference_ms"], r["vs_reference"], "yes" if targets[f"T{r['tokens']}"]["met"] else "NO",
                  "yes" if r["vs_floor"] <= 1.5 else "NO"]
                 for r in results.values()])
    print("\nRouting and the whole layer (router logits in), and each stage's kernels (profiled, eager"
          + ("; with PDL a kernel's time includes its early start's wait: PAGEDNB_PDL=0 for clean ones)" if pdl
             else ")"))
    print_table(["tokens", "routing ms", "torch routing ms", "layer ms", "layer x dense"]
                + [label for _, label in STAGES] + ["grouped_mm path ms"],
                [[r["tokens"], r["routing_ms"], r["routing_torch_ms"], r["layer_ms"], r["layer_vs_dense"]]
                 + [r["kernel_ms"].get(label, 0.0) for _, label in STAGES] + [r["grouped_mm_path_ms"]]
                 for r in results.values()])


if __name__ == "__main__":
    main()
