"""A step's grammar bitmask, filled off the engine thread's critical path.

With asynchronous scheduling, step N+1's sampling waits for its bitmask and the bitmask for step N's tokens
(engine/structured_output.py). Once the matchers have N's tokens, `start` hands the fill of N+1's rows to a
worker thread (xgrammar's fill is C++ that releases the GIL) and the engine thread goes on: N's outputs,
scheduling N+2, writing N+2's inputs. Right before those inputs go to the device, N+1's sampling is queued
(ModelRunner._sample_deferred): `take` waits for the fill (done by then in practice) and queues the copy of
the rows to the device, in stream order behind N+1's forward: the step is bound by the host's work, not the
device's, so a side stream would cost the host more (its events) than it saves the device.
Synchronous steps (and any step `start` was not called for) fill in `take`.

The pinned host bitmask is reused: it is refilled only after its last copy finished (long before, in practice:
that step's tokens were collected).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from pagednb.engine.structured_output import GrammarCache
from pagednb.request import Request


class GrammarBitmask:
    """Fills and ships the [rows, ceil(V / 32)] int32 bitmask of the steps' sampled requests."""

    def __init__(self, grammars: GrammarCache, device: torch.device) -> None:
        self.grammars = grammars
        self.device = device
        self._worker: ThreadPoolExecutor | None = None  # made at the first fill started ahead
        # the fill in progress: (the step's sampled requests, its future: whether any row has a live grammar)
        self._started: tuple[list[Request], Future] | None = None
        self._on_gpu = device.type == "cuda"
        self._pinned: torch.Tensor | None = None
        self._host: torch.Tensor | None = None  # the rows being filled / last filled
        self._copied = torch.cuda.Event() if self._on_gpu else None  # the last host -> device copy finished

    def start(self, reqs: list[Request]) -> None:
        """Begins filling the rows of a step whose sampled requests are `reqs` (their matchers have every
        token so far) on the worker thread; `take(reqs)` collects them."""
        self._finish_started()
        host = self._host_rows(len(reqs))
        self._started = (reqs, self._executor().submit(self._fill, host, reqs))

    def take(self, reqs: list[Request]) -> torch.Tensor | None:
        """The bitmask of the step sampling `reqs` (on the device: a copy queued on the current stream), or
        None when no row has a live grammar."""
        if self._started is not None and self._started[0] is reqs:
            live = self._started[1].result()
            self._started = None
            host = self._host
        else:
            self._finish_started()
            host = self._host_rows(len(reqs))
            live = self._fill(host, reqs)
        if not live:
            return None
        if not self._on_gpu:
            return host
        rows = host.to(self.device, non_blocking=True)
        self._copied.record()
        return rows

    def close(self) -> None:
        self._finish_started()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def _fill(self, host: torch.Tensor, reqs: list[Request]) -> bool:
        """Fills host's rows for reqs; whether any row has a live grammar. Rows whose request ended since its
        step was scheduled stay all-allowed: their tokens are dropped anyway (on the worker thread such a
        status read may be a step old: only such rows can differ). A terminated grammar's request has ended
        (the engine stops it as the matcher accepts the stop token), so no matcher is asked: this loop holds
        the GIL, which the engine thread wants meanwhile."""
        rows, states = [], []
        for i, req in enumerate(reqs):
            state = req.logits_state
            if state is not None and state.structured is not None and not req.is_finished:
                rows.append(i)
                states.append(state.structured)
        if rows:
            self.grammars.fill_bitmask(host, states, rows)
        return bool(rows)

    def _finish_started(self) -> None:
        """Waits for a fill that nobody will take (its step ended another way), so its buffer is free; what
        it raised concerns nobody now."""
        started, self._started = self._started, None
        if started is not None:
            wait([started[1]])

    def _executor(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="pagednb-grammar")
        return self._worker

    def _host_rows(self, num_rows: int) -> torch.Tensor:
        """Host rows to fill: pinned and reused on a GPU (once its last copy is done), fresh on the CPU (the
        sampler reads them there)."""
        if not self._on_gpu:
            self._host = self.grammars.allocate_bitmask(num_rows)
            return self._host
        if self._pinned is None or self._pinned.shape[0] < num_rows:
            self._pinned = torch.empty((max(num_rows, 64), self.grammars.bitmask_width), dtype=torch.int32,
                                       pin_memory=True)
        self._copied.synchronize()  # (an event never recorded returns at once)
        self._host = self._pinned[:num_rows]
        return self._host
