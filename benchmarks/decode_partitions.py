"""Batch-1 decode attention by split-K partition size, on the Qwen3-0.6B shape (16 q / 8 kv heads x 128, bf16).

One decode row per layer, 28 layers each with its own cache, captured in one CUDA graph as the engine's decode
graph runs them, the split planned for max_model_len 2048 as the graphs plan it: the engine's plan beside
forced partitions of a fixed size, at latency.py's batch-1 contexts (512-768) and longer. The partials of a
row are merged inside the attention kernel by the partition that finishes last. Reports us per launch (the
median replay / 28), i.e. the attention's share of a batch-1 step divided by the layers.

    python benchmarks/decode_partitions.py [--contexts 512,768,2048] [--sizes 64,96,128,256] [--reps 200]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # pagednb from this checkout

from common import capture_graph, print_table, replay_ms, save  # noqa: E402

import torch  # noqa: E402

from pagednb.attention import AttentionMetadata  # noqa: E402

H, HKV, D, BS, LAYERS, PLAN_LEN = 16, 8, 128, 16, 28, 2048
DT = torch.bfloat16


def layer_inputs(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A query row, a cache with room for PLAN_LEN tokens and its shuffled block table."""
    blocks = -(-PLAN_LEN // BS)
    cache = torch.randn(2, blocks, BS, HKV, D, device="cuda", generator=gen).to(DT)
    table = torch.randperm(blocks, device="cuda", generator=gen).int().view(1, blocks)
    q = torch.randn(1, H, D, device="cuda", generator=gen).to(DT)
    return q, cache, table


def metadata(context: int, table: torch.Tensor) -> AttentionMetadata:
    """A batch-1 decode step planned as the graphs plan it: for the longest sequence (PLAN_LEN)."""
    return AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([context], dtype=torch.int32, device="cuda"), block_tables=table,
        max_query_len=1, max_seq_len=PLAN_LEN, query_start_loc_cpu=[0, 1], seq_lens_cpu=[PLAN_LEN])


def us_per_launch(backend, layers, context: int, reps: int) -> tuple[float, int]:
    """Median us per attention launch of a graph of all layers' launches, and the plan's partitions."""
    mds = [metadata(context, table) for _, _, table in layers]
    calls = [lambda q=q, c=c, md=md: backend.attend(q, c, md, D ** -0.5, None) for (q, c, _), md in zip(layers, mds)]
    ms = replay_ms(capture_graph(calls), reps)
    partitions = next(iter(mds[0]._cuda_plan.row_plans.values()))[0]
    return ms * 1000 / len(calls), partitions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="512,768,2048")
    ap.add_argument("--sizes", default="64,96,128,256", help="forced partition sizes (tokens)")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    from pagednb.attention.cuda_backend import CudaPagedBackend
    backend = CudaPagedBackend()
    engine_plan = backend._row_plan
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows, result = [], {}
    for context in (int(c) for c in args.contexts.split(",")):
        layers = [layer_inputs(gen) for _ in range(LAYERS)]
        for size in [None, *sizes]:
            if size is None:
                backend._row_plan = engine_plan
            else:
                backend._row_plan = lambda *a, size=size: (-(-PLAN_LEN // size), size, engine_plan(*a)[2])
            us, partitions = us_per_launch(backend, layers, context, args.reps)
            label = "engine plan" if size is None else f"{size}-token partitions"
            rows.append([context, label, partitions, us])
            result[f"context_{context}_{size or 'engine'}"] = {"us_per_launch": us, "partitions": partitions}
        del layers
    print_table(["context", "plan", "P", "us per launch"], rows)
    print(f"saved {save('decode_partitions', result)}")


if __name__ == "__main__":
    main()
