"""Rank 0's model runner of a tensor-parallel engine: the one-GPU ModelRunner, telling the workers
each thing that they must do in step with it (every collective of the model must be joined by all).

What the workers mirror: the memory profile of the KV pool's sizing, the pool's allocation, the decode
CUDA graphs' capture (the same buckets in the same order, so each graph holds the same collectives),
and every step's forward (its inputs sent right after rank 0 wrote them, step_broadcast.py). Sampling,
logits processors and everything after them stay on rank 0.

An error after a step's inputs were sent leaves the ranks out of step (some wait in a collective the
others will never reach), so it ends the engine (TensorParallelError) instead of failing only that
step's requests as on one GPU; an error before (building the inputs) stays a one-step failure.
"""
from __future__ import annotations

import time

from pagednb.distributed.step_broadcast import Op, StepSender, send_op
from pagednb.distributed.worker_pool import WorkerPool
from pagednb.engine.logprobs import prompt_rows
from pagednb.engine.model_runner import LaunchedStep, ModelRunner
from pagednb.engine.scheduler import SchedulerOutput
from pagednb.engine.step_buffers import StepViews

POLL_S = 50e-6  # how often a wait for the GPU looks up (a dead worker would leave it waiting forever)


class TensorParallelRunner(ModelRunner):
    def __init__(self, workers: WorkerPool, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        workers.connect()  # the model is loaded: now wait for the workers (they loaded theirs meanwhile)
        self.workers = workers
        self.tensor_parallel = workers.group
        self.sender = StepSender(workers.group, self.buffers)
        self._profiling = False  # profile_run allocates a scratch pool the workers make on their own
        self._step_sent = False
        self._graph_size = 0
        self._prompt_rows: list[int] = []

    # ---- what the workers do with rank 0 -----------------------------------------------------------
    def profile_run(self, num_tokens: int, max_model_len: int) -> int:
        self._tell(Op.PROFILE_KV_POOL)
        self._profiling = True
        try:
            return super().profile_run(num_tokens, max_model_len)
        finally:
            self._profiling = False

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if not self._profiling:
            self._tell(Op.ALLOCATE_KV_CACHE, num_blocks)
        super().allocate_kv_cache(num_blocks)

    def capture_decode_graphs(self, max_batch_size: int, progress: bool = True) -> None:
        self._tell(Op.CAPTURE_GRAPHS, max_batch_size)
        super().capture_decode_graphs(max_batch_size, progress)

    def _tell(self, op: Op, *args: int) -> None:
        self.workers.check_alive()
        try:
            send_op(self.tensor_parallel, op, *args)
        except Exception as error:
            raise self.workers.failure(error) from error

    # ---- steps --------------------------------------------------------------------------------------
    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        self.workers.check_alive()
        self._step_sent = False
        try:
            return super().launch(sched)
        except Exception as error:
            if not self._step_sent:
                raise  # nothing reached the workers: the step fails alone, as on one GPU
            raise self.workers.failure(error) from error

    def prepare_inputs(self, sched: SchedulerOutput):
        self._graph_size = 0
        self._prompt_rows = prompt_rows(sched)[0] if sched.wants_prompt_logprobs else []
        return super().prepare_inputs(sched)

    def _fill_decode(self, sched: SchedulerOutput, batch_size: int):
        self._graph_size, self._prompt_rows = batch_size, []
        return super()._fill_decode(sched, batch_size)

    def _upload(self, v: StepViews, pending_rows: list[int], pending_sources: list[int]) -> None:
        super()._upload(v, pending_rows, pending_sources)
        self._step_sent = True  # from here on, a failure may leave a worker inside a collective
        self.sender.send_step(v, self._graph_size, bool(pending_rows), self._prompt_rows)

    def collect(self, launched: LaunchedStep) -> tuple[list[int], object]:
        """As ModelRunner.collect, waiting for the GPU in short polls that also look at the workers: a
        worker that died mid-step leaves this rank's collective, and so the step, unfinished for ever."""
        self.finish_sampling(launched)
        if launched.ready is not None:
            while not launched.ready.query():
                self.workers.check_alive()
                time.sleep(POLL_S)
        return super().collect(launched)
