"""CUDA graphs for decode steps: one graph per batch-size bucket, captured once at start.

A decode step of a small model is a thousand tiny kernels; launched one by one from Python the GPU
waits on the host most of the time. Captured in a graph, a step is one launch. A graph fixes every
address and every launch parameter, so:
  * its inputs are the step buffers' views for its batch size, written in place by the model runner
    before each replay; a batch is padded up to the next bucket with rows that read one token of
    block 0 and write nothing (slot -1);
  * attention is planned for the longest possible sequence (max_model_len): the split-K partitions past
    a sequence's real length find no keys and the reduce ignores them;
  * the graph ends with the LM head, so a replay leaves the logits of every row in one static tensor.
Graphs share one memory pool, captured largest first, so all buckets together cost about what the
largest one does. Steps with prefill chunks, or more rows than the largest bucket, run eagerly.

The graphs know nothing of the model runner: it hands `capture` the one thing capturing needs, the
forward of a padded decode step of each bucket size, and replays them by size.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagednb.engine.graph_edges import gemm_edge_policy, make_gemm_edges_programmatic

if TYPE_CHECKING:
    from pagednb.engine.scheduler import SchedulerOutput

logger = logging.getLogger("pagednb")


class DecodeGraphs:
    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        # bucket of every batch size up to the largest: the smallest captured size that holds it
        self._bucket = [0] * (self.max_size + 1)
        j = 0
        for n in range(1, self.max_size + 1):
            while self.sizes[j] < n:
                j += 1
            self._bucket[n] = self.sizes[j]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        # GEMM launches that may start while the kernel before them finishes (graph_edges.py), all graphs
        self.programmatic_edges = 0

    @staticmethod
    def bucket_sizes(max_batch_size: int) -> list[int]:
        """1, 2, 4, 8, then every multiple of 16 up to max_batch_size (which is always included)."""
        sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size] + list(range(16, max_batch_size, 16))
        return sizes + [max_batch_size]

    @staticmethod
    def rows_bucket(n: int, limit: int) -> int:
        """The smallest of bucket_sizes' sizes (1, 2, 4, 8, a multiple of 16) that holds n rows, at most limit
        (>= n). An eager step runs its LM head over this many rows, so cuBLAS meets few GEMM shapes, those the
        graphs' capture met among them: each new one costs ~8 ms of host time once per process (benchmarks/NOTES.md,
        issue 19's fourteenth round), and the steps that prefill the first prompts meet a new one each."""
        if n <= 0:
            return 0  # no LM head at all (a tensor-parallel worker runs one where rank 0 does)
        return next(size for size in DecodeGraphs.bucket_sizes(limit) if size >= n)

    def size_for(self, sched: SchedulerOutput) -> int | None:
        """The bucket for this step, or None when it must run eagerly (prefill tokens, too many rows)."""
        n = len(sched.scheduled) + sched.num_draft_tokens  # a drafted request's tokens are rows of their own
        if n > self.max_size:
            return None
        if sched.num_draft_tokens:
            ok = all(s.num_new_tokens == 1 + len(s.draft_token_ids) and s.samples for s in sched.scheduled)
            return self._bucket[n] if ok else None
        for s in sched.scheduled:
            if s.num_new_tokens != 1 or not s.samples:
                return None
        return self._bucket[n]

    @torch.inference_mode()
    def capture(self, padded_forward: Callable[[int], Callable[[], torch.Tensor]], device: torch.device,
                progress: bool = True) -> None:
        """Captures every bucket, largest first. padded_forward(batch_size) makes every row of that
        bucket's inputs a padding row (so a capture writes nothing into the cache) and returns the
        forward over those inputs, which returns the logits; making it is host work (buffer writes,
        attention planning), so it happens before, never inside, a capture."""
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = None
        accepts = gemm_edge_policy(device)
        sizes = sorted(self.sizes, reverse=True)
        bar = _progress(len(sizes), progress)
        for batch_size in sizes:
            padded_forward(batch_size)()  # warm-up: library handles, kernel attributes
            torch.cuda.synchronize(device)
            # a fresh forward, its attention planned anew: whatever device work the backend plans per step
            # is then recorded in the graph, never read from tensors of the warm-up's plan, which are
            # freed by now
            forward = padded_forward(batch_size)
            graph = torch.cuda.CUDAGraph(keep_graph=accepts is not None)
            with torch.cuda.graph(graph, pool=pool):
                logits = forward()
            if accepts is not None:
                accepts = self._overlap_gemms(graph, accepts)
                graph.instantiate()
            pool = graph.pool()
            self._graphs[batch_size], self._logits[batch_size] = graph, logits
            if bar is not None:
                bar.update(1)
        torch.cuda.synchronize(device)
        if bar is not None:
            bar.close()
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("Captured %d decode CUDA graphs (batch sizes 1-%d) in %.1f s, %.2f GiB%s",
                    len(self.sizes), self.max_size, time.perf_counter() - t0, used / 2**30,
                    f"; {self.programmatic_edges} GEMM launches overlap the kernel before them"
                    if self.programmatic_edges else "")

    def _overlap_gemms(self, graph: torch.cuda.CUDAGraph,
                       accepts: Callable[[str, str], bool]) -> Callable[[str, str], bool] | None:
        """Gives the graph's cuBLAS GEMMs programmatic edges (graph_edges.py); returns the policy for the
        next graph, or None after a failure (the graph stays as captured: the rewrite restores what it
        could not change)."""
        try:
            self.programmatic_edges += make_gemm_edges_programmatic(graph.raw_cuda_graph(), accepts)
            return accepts
        except (OSError, AttributeError, RuntimeError) as e:
            logger.warning("decode graphs: GEMM launches keep plain edges (%s)", e)
            return None

    def replay(self, batch_size: int) -> torch.Tensor:
        """Runs the graph of this bucket over the inputs already written; returns its logits [bucket, V]."""
        self._graphs[batch_size].replay()
        self.num_replays += 1
        return self._logits[batch_size]


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Capturing decode CUDA graphs", unit="graph", leave=False)
