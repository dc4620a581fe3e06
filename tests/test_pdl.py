"""Programmatic dependent launch (kernels_cuda/common.cuh): each pagednb kernel may start while the one
before it finishes, and waits (griddepcontrol.wait) before it reads that kernel's output.

GPU only (the H200 device; skipped elsewhere). The switch is read once per process, so each setting runs
in its own subprocess over the same model, the Qwen3-0.6B shape with random bf16 weights:

  * on a GPU of compute capability 9.0 or later PDL is on by default, GEMMs included, and PAGEDNB_PDL=0
    turns it off (PAGEDNB_GEMM_PDL=0: off for the GEMMs only);
  * the engine's outputs are the same bits either way: greedy tokens at batch 1 (GEMV with its weights
    loaded before the wait, SiLU-input GEMV, fused norms, q/k norm + RoPE + cache write, split-K decode
    attention merged in the kernel, the greedy kernel, all in one CUDA graph) and at batch 4 (cuBLAS between
    them), and the logprobs of temperature-sampled tokens (the sampling kernel). A kernel reading its input
    before the kernel before it has written it would change them; so would a GEMM reading or writing, before its
    wait, memory that the kernel before it still uses (graph_edges.py). The same comparison runs over an fp8
    cache (the tensor-core decode kernel at 2 query heads per kv head).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_support import CUDA, GPU_REASON

pytestmark = pytest.mark.skipif(not CUDA, reason=GPU_REASON)

ROOT = Path(__file__).resolve().parents[1]

_RUN = r"""
import json, sys
from pagednb import LLM, SamplingParams
from pagednb.kernels import load_kernels

path, kv_cache_dtype = sys.argv[1], sys.argv[2]
prompts = [{"prompt_token_ids": [(37 * i + 11 * r) % 151000 for i in range(300 + 40 * r)]} for r in range(4)]
greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)
with LLM(path, gpu_memory_utilization=0.3, max_num_seqs=4, max_model_len=2048, kv_cache_dtype=kv_cache_dtype) as llm:
    one = llm.generate(prompts[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    four = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    out = llm.generate(prompts[:1], sampled, use_tqdm=False)[0].outputs[0]
    logprobs = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]
    replays = llm.engine.runner.graphs.num_replays
    edges = llm.engine.runner.graphs.programmatic_edges
print(json.dumps({"pdl": load_kernels().pagednb_pdl_enabled(), "one": one, "four": four,
                  "sampled": out.token_ids, "logprobs": logprobs, "replays": replays, "edges": edges}))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_shapes", ROOT / "benchmarks" / "shapes.py")
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    return shapes.make_model_dir("qwen3-0.6b", tmp_path_factory.mktemp("qwen3-0.6b"))


def _run(model_dir: Path, kv_cache_dtype: str = "auto", **switches: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PAGEDNB_PDL", "PAGEDNB_GEMM_PDL")}
    env.update(switches)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _RUN, str(model_dir), kv_cache_dtype], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(model_dir):
    return {"default": _run(model_dir), "off": _run(model_dir, PAGEDNB_PDL="0"),
            "gemms off": _run(model_dir, PAGEDNB_GEMM_PDL="0"),
            "fp8 default": _run(model_dir, "fp8"), "fp8 gemms off": _run(model_dir, "fp8", PAGEDNB_GEMM_PDL="0")}


def test_pdl_is_on_by_default_on_hopper_and_off_under_the_switch(runs):
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert runs["default"]["pdl"] == (1 if hopper else 0)
    assert runs["off"]["pdl"] == 0
    # the GEMMs of every decode graph from 2 rows up (batch 1 runs pagednb's GEMV) overlap the kernel before them
    assert (runs["default"]["edges"] > 0) == hopper and (runs["fp8 default"]["edges"] > 0) == hopper
    assert runs["off"]["edges"] == 0 and runs["gemms off"]["edges"] == 0 and runs["fp8 gemms off"]["edges"] == 0
    assert runs["gemms off"]["pdl"] == runs["default"]["pdl"]


@pytest.mark.parametrize("default, other", [("default", "off"), ("default", "gemms off"),
                                            ("fp8 default", "fp8 gemms off")])
def test_outputs_are_the_same_bits_with_and_without_pdl(runs, default, other):
    on, off = runs[default], runs[other]
    assert on["replays"] > 0 and off["replays"] > 0  # the decode steps ran in CUDA graphs
    for key in ("one", "four", "sampled", "logprobs"):
        assert on[key] == off[key], key
