"""Whole-run A/B on the standard workload (throughput.py's), all configurations in one process on one model folder.

Two engines of the same code differ by 1-3% run to run (benchmarks/NOTES.md), more than many changes worth having,
so each configuration here is an environment setting that the engine reads when it starts (PAGEDNB_ROW_VARIANT,
PAGEDNB_LONGEST_FIRST, PAGEDNB_GEMM_PDL, PAGEDNB_FUSE_ROPE, PAGEDNB_FUSE_ROPE_WAVES, PAGEDNB_FUSE_ROPE_SPLIT), and
the configurations run in turn, in order and then in reverse, each on a fresh LLM: a slow spell of the machine falls
on all of them alike. Until issue 19's fourteenth round the first run of a process ran 1-5% slow (cuBLAS met a new
LM-head shape in each of its prefill steps; eager steps now pad those rows to a graph bucket size), so --warmup runs
(default 1) of the first configuration still come first and are not counted. PAGEDNB_PDL is read once per process,
so it is not an A/B knob here.

    python benchmarks/whole_run_ab.py --shape qwen3-0.6b --kv-cache-dtype fp8 \
        --configs default PAGEDNB_ROW_VARIANT=4
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from unittest import mock

from common import print_table, save
from shapes import SHAPES, make_model_dir, workload
from throughput import run_pagednb


def parse_config(text: str) -> dict[str, str]:
    """"KEY=VALUE[,KEY=VALUE...]" -> the environment settings of one configuration ("" or "default": none)."""
    if text in ("", "default"):
        return {}
    settings = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.startswith("PAGEDNB_"):
            raise SystemExit(f"a configuration is PAGEDNB_KEY=VALUE[,...] or 'default', got {text!r}")
        settings[key] = value
    return settings


def run_with(settings: dict[str, str], model_dir: Path, prompts, outputs, args) -> dict:
    with mock.patch.dict(os.environ, settings):  # restored afterwards, whatever was set before
        return run_pagednb(model_dir, prompts, outputs, args)["all"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--configs", nargs="+", default=["default"], help="KEY=VALUE[,KEY=VALUE] per configuration")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the configurations, each in order and reversed")
    ap.add_argument("--tag", default="", help="a name for the result file (whole_run_ab_<shape>_<kv>_<tag>.json)")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted runs of the first configuration before the rounds")
    a = ap.parse_args()
    configs = [(c, parse_config(c)) for c in a.configs]
    args = argparse.Namespace(max_num_seqs=256, max_num_batched_tokens=8192, eager=False, shape=a.shape,
                              kv_cache_dtype=a.kv_cache_dtype, hf="", hf_requests=256, breakdown=False)
    prompts, outputs = workload(256, SHAPES[a.shape]["vocab_size"])
    runs: dict[str, list[float]] = {name: [] for name, _ in configs}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(a.shape, Path(tmp) / a.shape)
        warmups = []
        for _ in range(a.warmup):
            r = run_with(configs[0][1], model_dir, prompts, outputs, args)
            warmups.append(r["output_tok_per_s"])
            print(f"(warm-up, not counted) {configs[0][0]}: {r['output_tok_per_s']:,.0f} output tok/s", flush=True)
        for _ in range(a.rounds):
            for order in (configs, configs[::-1]):
                for name, settings in order:
                    r = run_with(settings, model_dir, prompts, outputs, args)
                    runs[name].append(r["output_tok_per_s"])
                    print(f"{name}: {r['output_tok_per_s']:,.0f} output tok/s ({r['wall_s']:.3f} s)", flush=True)
    rows = [[name, statistics.mean(v), min(v), max(v), len(v)] for name, v in runs.items()]
    print_table(["configuration", "mean tok/s", "min", "max", "runs"], rows)
    name = f"whole_run_ab_{a.shape}_{a.kv_cache_dtype}" + (f"_{a.tag}" if a.tag else "")
    path = save(name, {"shape": a.shape, "kv_cache_dtype": a.kv_cache_dtype, "configs": a.configs,
                       "output_tok_per_s": runs, "warmup_tok_per_s": warmups})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
