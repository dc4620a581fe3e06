"""Small-batch linear layers: pagednb's GEMV kernel (kernels_cuda/gemv.cu) beside F.linear (cuBLAS).

Rows: every projection of the Qwen3-0.6B and Llama-3.2-1B shapes (fused qkv, o, fused gate/up, down,
LM head; bf16) at M = 1 and 2 rows, the kernel called directly and cuBLAS; `linear()` takes the kernel
where small_linear.gemv_serves says so (the "linear uses" column), a choice made from this table. Each is timed inside one CUDA graph of 64 back-to-back calls rotating over enough weight
copies to exceed the 60 MB L2 (as a decode step meets its weights: cold), median over replays divided by
64, so the figure is the kernel's own time (a replay per call would add ~9 us of launch to each); GB/s
counts the weight bytes. The last column is the largest difference from a float64 reference over the output's RMS, for
both (bf16 output rounding alone is up to ~4e-3 of a value).

    python benchmarks/linear.py [--reps 20] [--shapes qwen3-0.6b,llama-3.2-1b]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # pagednb from this checkout

from common import capture_graph, print_table, replay_ms, save  # noqa: E402
from kernels import L2_BYTES  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {  # name: (hidden, q heads x head_dim, kv heads x head_dim, intermediate, vocab)
    "qwen3-0.6b": (1024, 16 * 128, 8 * 128, 3072, 151936),
    "llama-3.2-1b": (2048, 32 * 64, 8 * 64, 8192, 128256),
}
ROWS = [1, 2]


def projections(hidden: int, q: int, kv: int, inter: int, vocab: int) -> dict[str, tuple[int, int]]:
    """(N, K) of each weight."""
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "lm_head": (vocab, hidden)}


def rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest |out - exact| over the RMS of exact (bf16 rounding alone gives up to ~2^-9 x |value|)."""
    return ((out.double() - exact).abs().max() / exact.pow(2).mean().sqrt()).item()


CALLS_PER_GRAPH = 64


def per_call_ms(fns, reps: int) -> float:
    """Median ms per call over replays of one CUDA graph of CALLS_PER_GRAPH calls cycling over fns."""
    return replay_ms(capture_graph([fns[i % len(fns)] for i in range(CALLS_PER_GRAPH)]), reps) / CALLS_PER_GRAPH


def bench(n: int, k: int, m: int, reps: int, gen: torch.Generator) -> dict:
    from pagednb.model.small_linear import KERNEL, gemv_serves
    kernel = KERNEL.get()
    nbytes = n * k * 2
    copies = max(1, min(CALLS_PER_GRAPH, -(-3 * L2_BYTES // nbytes)))  # 3x the L2: every call reads cold
    weights = [(torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    ours = per_call_ms([lambda w=w: kernel.gemv(x, w, None) for w in weights], reps)
    cublas = per_call_ms([lambda w=w: F.linear(x, w) for w in weights], reps)
    exact = x.double() @ weights[0].double().T
    err_ours = rel_err(kernel.gemv(x, weights[0], None), exact)
    err_cublas = rel_err(F.linear(x, weights[0]), exact)
    del weights
    torch.cuda.empty_cache()
    return {"ours_us": ours * 1e3, "cublas_us": cublas * 1e3, "ours_GBps": nbytes / ours / 1e6,
            "cublas_GBps": nbytes / cublas / 1e6, "weight_bytes": nbytes, "max_err_ours": err_ours,
            "max_err_cublas": err_cublas, "linear_uses": "gemv" if gemv_serves(m, n) else "cublas"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    args = ap.parse_args()
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    from pagednb.kernels import load_error, load_kernels
    if load_kernels() is None:
        raise SystemExit(f"CUDA kernels unavailable: {load_error()}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    res: dict = {}
    rows = []
    for shape, dims in shapes.items():
        for name, (n, k) in projections(*dims).items():
            for m in ROWS:
                r = res[f"{shape}/{name}/M{m}"] = bench(n, k, m, args.reps, gen)
                rows.append([shape, name, f"{n}x{k}", m, r["ours_us"], r["cublas_us"], r["ours_GBps"], r["cublas_GBps"],
                             f"{r['max_err_ours']:.1e} / {r['max_err_cublas']:.1e}", r["linear_uses"]])
            print(f"{shape} {name} done", flush=True)
    layers = {"qwen3-0.6b": 28, "llama-3.2-1b": 16}
    # one decode step's GEMMs: the 4 layer projections x layers + the LM head, as linear() runs them
    per_step = {}
    for shape in shapes:
        for m in ROWS:
            step = {"linear_us": 0.0, "gemv_everywhere_us": 0.0, "cublas_us": 0.0}
            for p in ("qkv", "o", "gate_up", "down", "lm_head"):
                r = res[f"{shape}/{p}/M{m}"]
                times = 1 if p == "lm_head" else layers[shape]
                step["linear_us"] += times * (r["ours_us"] if r["linear_uses"] == "gemv" else r["cublas_us"])
                step["gemv_everywhere_us"] += times * r["ours_us"]
                step["cublas_us"] += times * r["cublas_us"]
            per_step[f"{shape}/M{m}"] = step
    path = save("linear", {"results": res, "decode_step_gemms": per_step})
    print(f"wrote {path}")
    print_table(["shape", "proj", "N x K", "M", "GEMV us", "cuBLAS us", "GEMV GB/s", "cuBLAS GB/s",
                 "max err / rms: GEMV / cuBLAS", "linear uses"], rows)
    print_table(["shape", "M", "step GEMMs as linear() runs them, us", "GEMV everywhere", "cuBLAS everywhere"],
                [[k.split("/")[0], k.split("/")[1], v["linear_us"], v["gemv_everywhere_us"], v["cublas_us"]]
                 for k, v in per_step.items()])


if __name__ == "__main__":
    main()
