"""Rank 0's handle on the worker processes: start them, notice when one dies, end them.

Workers are spawned: fresh interpreters (CUDA cannot be forked, and a notebook kernel's state must not
be copied) started from rank 0's own process, which stays the notebook's kernel: the engine, its
streams and widgets keep running there. They run `python -m pagednb.distributed.worker` rather than
multiprocessing's spawn, which re-imports the parent's main script in each child: a script creating an
LLM at top level would then need an `if __name__ == "__main__"` guard; this way nothing is needed
from the user, in a notebook, `python -c` or a script. The child gets the parent's sys.path (pagednb
importable as it is here), its EngineConfig through the store, and ignores SIGINT: Ctrl-C in a
terminal reaches the whole process group, and pagednb turns it into aborting requests on rank 0, not
into dead workers.

A dead worker must never hang rank 0: each step starts by asking whether every worker still runs (a
non-blocking waitpid), collectives with a dead peer fail (gloo: the socket closes; NCCL: the wait for
the GPU polls, tp_runner.py), and the error names the rank, its exit code or signal, and the worker's
own error when it managed to report one.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import replace

import torch

from pagednb.config import EngineConfig
from pagednb.distributed.process_group import TensorParallelGroup, make_store
from pagednb.distributed.step_broadcast import Op, send_op

logger = logging.getLogger("pagednb")
JOIN_TIMEOUT_S = 5.0  # a worker told to stop that has not stopped by then is terminated
DEATH_NOTICE_S = 3.0  # after a failed collective, how long to wait for a dying worker's exit to show
ERROR_KEY = "worker_error/{rank}"  # where a worker leaves its traceback in the store before exiting
CONFIG_KEY = "config"  # the workers' EngineConfig, pickled


class TensorParallelError(RuntimeError):
    """The ranks of a tensor-parallel engine can no longer work together (a worker died, or an error left
    them out of step): the engine stops; every request under way ends with this error."""


def rank_devices(device: torch.device, world_size: int) -> list[torch.device]:
    """Each rank's device: on GPUs, consecutive ones from rank 0's; on a CPU, the CPU. One rank: device."""
    if device.type != "cuda" or world_size == 1:
        return [device] * world_size
    first = device.index if device.index is not None else torch.cuda.current_device()
    available = torch.cuda.device_count()
    if first + world_size > available:
        raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs from {device} on, but "
                         f"this machine has {available} (cuda:0 to cuda:{available - 1})")
    return [torch.device("cuda", first + rank) for rank in range(world_size)]


class WorkerPool:
    def __init__(self, processes: list, group: TensorParallelGroup, store) -> None:
        self.processes = processes  # rank i + 1 is processes[i]
        self.group = group  # rank 0's; joined by connect()
        self.store = store
        self.closed = False

    @classmethod
    def start(cls, config: EngineConfig, devices: list[torch.device], attention_backend: str) -> WorkerPool:
        """Spawns ranks 1.. and returns at once: rank 0 (this process, on devices[0]) loads its shard while
        they start, then joins them (connect)."""
        world_size = len(devices)
        store = make_store(world_size)
        store.set(CONFIG_KEY, pickle.dumps(replace(config, attention_backend=attention_backend)))  # rank 0's backend
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        processes = [subprocess.Popen([sys.executable, "-m", "pagednb.distributed.worker", str(rank), str(world_size),
                                       str(store.port), str(devices[rank])], env=env)
                     for rank in range(1, world_size)]
        logger.info("Tensor parallel: %d ranks (%s), workers' pids %s", world_size,
                    ", ".join(map(str, devices)), ", ".join(str(p.pid) for p in processes))
        return cls(processes, TensorParallelGroup(0, world_size, devices[0]), store)

    def connect(self) -> None:
        """Joins rank 0 to the workers' process groups, once every worker has loaded its shard."""
        self._wait_until_joined()
        self.group.connect(self.store)

    def _wait_until_joined(self) -> None:
        """Until every worker has loaded its shard and announced itself in the store: a worker that dies
        first (a bad import, no GPU, out of memory) is reported at once, not after the groups' timeout."""
        keys = [f"joining/{rank}" for rank in range(1, len(self.processes) + 1)]
        while not self.store.check(keys):
            self.check_alive()
            time.sleep(0.01)

    # ---- watching ---------------------------------------------------------------------------------
    def check_alive(self) -> None:
        """TensorParallelError if a worker has exited (a waitpid per worker, no blocking)."""
        dead = [(rank, p) for rank, p in enumerate(self.processes, start=1) if p.poll() is not None]
        if dead:
            raise TensorParallelError(self._obituary(dead))

    def failure(self, error: BaseException) -> TensorParallelError:
        """The error to raise after a collective or a step failed: the dead worker's, when one died (its
        sockets close a moment before its exit shows, so that is waited for a little)."""
        deadline = time.monotonic() + DEATH_NOTICE_S
        while time.monotonic() < deadline:
            try:
                self.check_alive()
            except TensorParallelError as dead:
                return dead
            time.sleep(0.02)
        return TensorParallelError(f"a step of the tensor-parallel engine failed after its inputs reached the "
                                   f"workers, leaving the ranks out of step ({error!r}); the engine has stopped. "
                                   f"Create a new LLM")

    def _obituary(self, dead: list) -> str:
        parts = []
        for rank, process in dead:
            code = process.returncode
            how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exit code {code}")
            parts.append(f"rank {rank} (pid {process.pid}) {how}")
            reported = self._reported_error(rank)
            if reported:
                parts[-1] += f", after this error:\n{reported}"
        return (f"tensor-parallel worker {'; '.join(parts)}. The engine has stopped: every request under way "
                f"ends with this error. Create a new LLM")

    def _reported_error(self, rank: int) -> str | None:
        key = ERROR_KEY.format(rank=rank)
        try:
            return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None
        except Exception:  # the store itself is gone
            return None

    # ---- ending ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Tells the workers to stop, waits a little, then terminates any left; frees the groups. Idempotent."""
        if self.closed:
            return
        self.closed = True
        told = False
        if self.group.control is not None and all(p.poll() is None for p in self.processes):
            try:
                send_op(self.group, Op.SHUTDOWN)
                told = True
            except Exception:  # a worker went away meanwhile: terminated below
                pass
        deadline = time.monotonic() + (JOIN_TIMEOUT_S if told else 0.2)
        for process in self.processes:
            _wait(process, deadline - time.monotonic())
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                _wait(process, 1.0)
            if process.poll() is None:
                process.kill()
                _wait(process, 1.0)
        self.group.close(abort=not told)


def _wait(process: subprocess.Popen, timeout: float) -> None:
    try:
        process.wait(max(timeout, 0.0))
    except subprocess.TimeoutExpired:
        pass

