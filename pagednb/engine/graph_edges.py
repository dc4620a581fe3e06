"""Programmatic edges into a captured CUDA graph's cuBLAS GEMMs.

pagednb's own kernels are launched with programmatic stream serialization (kernels_cuda/common.cuh): each
may start its CTAs while the kernel before it finishes, and waits (griddepcontrol.wait) before it reads
that kernel's output. cuBLAS launches its GEMMs without the attribute, so in a decode graph every GEMM
starts only after the kernel before it has drained: a launch gap per GEMM, three or four per decoder layer.
A graph edge can carry the same permission as the launch attribute (cudaGraphDependencyTypeProgrammatic):
this module rewrites the edges that `accepts` (source kernel name, GEMM kernel name) into such edges.

What makes an edge safe (H200 probes, benchmarks/NOTES.md issue 19's tenth and eleventh rounds;
tests/test_graph_edges.py): cuBLAS's Hopper GEMM kernels ("nvjet_sm90_...") do not wait (griddepcontrol.wait)
before all of their memory accesses.
  * Some write before the wait (their output or a workspace), and a GEMM's output may reuse a buffer that the
    kernel before it reads for the last time: behind a kernel that let its dependents start at its first
    line, an engine run with such edges produced NaN logits.
  * Some read part of their input before the wait: Llama-3.2-1B's gate_up at 80 and 200-256 rows read it
    early in 10-13 of 20 replays behind such a kernel.
So the kernel before the GEMM must be done with memory when it lets the GEMM launch, and its stores must be
visible by then without the GEMM's wait: pagednb's PdlLate kernels (kernels_cuda/common.cuh) trigger only by
exiting, after a GPU-wide fence behind their last store; the launchers pick them where a GEMM comes next.

The edges out of a GEMM into pagednb's kernels need no rewrite: a kernel launched with the PDL attribute is
captured with a programmatic edge from the node before it (issue 19's fourteenth round: a policy that also
admitted GEMM -> RMSNorm / gate-and-multiply / q/k norm + RoPE edges found none left to turn).
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import lru_cache

import torch

# A/B knob (benchmarks/whole_run_ab.py): "1" (the default) or "0"; PAGEDNB_PDL=0 turns it off with every other
# programmatic launch
GEMM_PDL_ENV = "PAGEDNB_GEMM_PDL"

_CU_GRAPH_NODE_TYPE_KERNEL = 0
_CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC = 1
_CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1


class _EdgeData(ctypes.Structure):
    """CUgraphEdgeData (cuda.h): a zeroed one is the default edge (full completion)."""
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h)."""
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc}")


def kernel_name(node: int) -> str | None:
    """The kernel's name of a graph node, or None for a node that is not a kernel."""
    cu = _driver()
    kind = ctypes.c_int()
    _check(cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
    if kind.value != _CU_GRAPH_NODE_TYPE_KERNEL:
        return None
    params = _KernelNodeParams()
    _check(cu.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(params)),
           "cuGraphKernelNodeGetParams")
    name = ctypes.c_char_p()
    if params.func:
        _check(cu.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)), "cuFuncGetName")
    else:
        _check(cu.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern)), "cuKernelGetName")
    return name.value.decode(errors="replace") if name.value else ""


def _edges(graph: int) -> list[tuple[int, int, _EdgeData]]:
    cu = _driver()
    n = ctypes.c_size_t()
    _check(cu.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(n)), "cuGraphGetEdges")
    src, dst = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)()
    data = (_EdgeData * n.value)()
    _check(cu.cuGraphGetEdges_v2(ctypes.c_void_p(graph), src, dst, data, ctypes.byref(n)), "cuGraphGetEdges")
    return [(src[i] or 0, dst[i] or 0, data[i]) for i in range(n.value)]


def make_gemm_edges_programmatic(raw_graph: int, accepts: Callable[[str, str], bool]) -> int:
    """Turns every default kernel -> kernel edge of the (not yet instantiated) graph that accepts(source
    name, destination name) into a programmatic one; returns how many it turned. The destination may then
    launch as soon as the source triggers (or its CTAs exit), so nothing it reads or writes before its own
    griddepcontrol.wait may still be in use by the source, and the source's stores must be visible by then
    (what `accepts` must ensure: the module's docstring)."""
    cu = _driver()
    names: dict[int, str | None] = {}

    def name(node: int) -> str | None:
        if node not in names:
            names[node] = kernel_name(node)
        return names[node]

    turned = 0
    for src, dst, data in _edges(raw_graph):
        if data.type != 0 or data.from_port != 0:
            continue
        src_name, dst_name = name(src), name(dst)
        if src_name is None or dst_name is None or not accepts(src_name, dst_name):
            continue
        s, d = (ctypes.c_void_p * 1)(src), (ctypes.c_void_p * 1)(dst)
        _check(cu.cuGraphRemoveDependencies_v2(ctypes.c_void_p(raw_graph), s, d, ctypes.byref(data), 1),
               "cuGraphRemoveDependencies")
        edge = _EdgeData(from_port=_CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, to_port=0,
                         type=_CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
        rc = cu.cuGraphAddDependencies_v2(ctypes.c_void_p(raw_graph), s, d, ctypes.byref(edge), 1)
        if rc != 0:  # put the edge back as it was, so the graph stays correct whatever failed
            _check(cu.cuGraphAddDependencies_v2(ctypes.c_void_p(raw_graph), s, d, ctypes.byref(data), 1),
                   "cuGraphAddDependencies (restoring an edge)")
            _check(rc, "cuGraphAddDependencies")
        turned += 1
    return turned


def graph_kernel_names(raw_graph: int) -> list[str]:
    """Every kernel node's name (a diagnosis aid: which library kernels a capture recorded)."""
    cu = _driver()
    n = ctypes.c_size_t()
    _check(cu.cuGraphGetNodes(ctypes.c_void_p(raw_graph), None, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * n.value)()
    _check(cu.cuGraphGetNodes(ctypes.c_void_p(raw_graph), nodes, ctypes.byref(n)), "cuGraphGetNodes")
    return [nm for nm in (kernel_name(nodes[i] or 0) for i in range(n.value)) if nm is not None]


def cublas_hopper_gemm(kernel: str) -> bool:
    """cuBLAS's Hopper GEMM kernels, the destinations the policy knows (every decode GEMM of the benchmark shapes
    at M = 1-256 runs one)."""
    return kernel.startswith("nvjet_sm90")


def done_with_memory_when_it_triggers(kernel: str) -> bool:
    """pagednb's PdlLate kernels (kernels_cuda/common.cuh) let the next kernel launch only as their CTAs exit,
    their stores fenced GPU-wide."""
    return "pagednb" in kernel and "PdlLate" in kernel


def gemm_edge_safe(source: str, gemm: str) -> bool:
    """The engine's policy: a cuBLAS Hopper GEMM behind a pagednb PdlLate kernel."""
    return cublas_hopper_gemm(gemm) and done_with_memory_when_it_triggers(source)


def gemm_edge_policy(device: torch.device) -> Callable[[str, str], bool] | None:
    """Which edges of a decode graph become programmatic on this device, or None: none (before Hopper,
    PAGEDNB_PDL=0 or PAGEDNB_GEMM_PDL=0)."""
    raw = os.environ.get(GEMM_PDL_ENV, "1").strip() or "1"
    if raw not in ("0", "1"):
        raise ValueError(f"{GEMM_PDL_ENV} must be 0 or 1, got {raw!r}")
    if raw == "0" or os.environ.get("PAGEDNB_PDL", "").strip() == "0" or device.type != "cuda":
        return None
    if torch.cuda.get_device_capability(device)[0] < 9:
        return None
    return gemm_edge_safe
