"""The ranks of one tensor-parallel engine and their two process groups (torch.distributed's own).

Every rank holds two groups over the same TCPStore: the control group (gloo, on the host) carries the
small messages that say what to do next (a step's header, the host copy of its inputs, the KV pool
size), and the device group carries the model's collectives: NCCL on GPUs (so CUDA graphs capture
them), gloo again on a CPU. The CPU test path is therefore the GPU path with the device group's
backend swapped. The groups are plain torch.distributed backends owned by this object, not the
process-wide default group, so two engines in one notebook never share or clobber global state.

Gloo collectives take TIMEOUT: a rank that stops answering raises on the others instead of hanging
(a rank that dies raises at once: its sockets close). NCCL has no such host-side timeout; the engine
watches the worker processes instead (worker_pool.py). NCCL's own watchdog must never end the process on
an error, since rank 0's process is the user's notebook kernel: the NCCL group is made with its
asynchronous error handling (which tears the process down) and its heartbeat monitor off, as PyTorch's
CUDA-graphs notes also ask for collectives captured in graphs.
"""
from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Long enough for a worker to load its shard of a large checkpoint before the first collective.
TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class TensorParallelGroup:
    """This process's rank among `world_size`, and the collectives the parallel layers call. Made before
    the groups exist (a model is sharded by rank alone), joined by `connect` before the first collective."""

    rank: int
    world_size: int
    device: torch.device
    control: dist.ProcessGroupGloo | None = None
    devices: object = None  # ProcessGroupNCCL on GPUs, ProcessGroupGloo on a CPU

    def connect(self, store: dist.Store) -> None:
        """Joins this rank to both groups (blocks until every rank has joined)."""
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), self.rank, self.world_size, TIMEOUT)
        device_store = dist.PrefixStore("devices", store)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            with _environment(TORCH_NCCL_ASYNC_ERROR_HANDLING="0", TORCH_NCCL_ENABLE_MONITORING="0"):
                self.devices = dist.ProcessGroupNCCL(device_store, self.rank, self.world_size, options)
        else:
            self.devices = dist.ProcessGroupGloo(device_store, self.rank, self.world_size, TIMEOUT)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the process that runs the engine (scheduler, sampler, streams)."""
        return self.rank == 0

    # ---- the model's collectives (device group) --------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place (row-parallel layers' partial outputs)."""
        self.devices.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world_size * n], rank order (vocab-parallel logits)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.devices.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast_device(self, x: torch.Tensor) -> None:
        """x from rank 0 to every rank's x, on the device (tokens sampled on rank 0's GPU)."""
        self.devices.broadcast(x, 0).wait()

    # ---- control messages (host, gloo) -----------------------------------------------------------
    def broadcast_host(self, x: torch.Tensor) -> None:
        """x (a contiguous CPU tensor) from rank 0 to every rank's x."""
        self.control.broadcast(x, 0).wait()

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (the KV pool every rank can afford)."""
        t = torch.tensor([value], dtype=torch.int64)
        self.control.allreduce([t], dist.ReduceOp.MIN).wait()
        return int(t.item())

    def close(self, abort: bool = False) -> None:
        """Ends both groups' connections; abort: without waiting for collectives a dead peer never joined."""
        for group in (self.devices, self.control):
            if group is None:
                continue
            try:
                group.abort() if abort else group.shutdown()
            except Exception:  # torn down already, or a backend without that call: its connections close with it
                pass


def make_store(world_size: int) -> dist.TCPStore:
    """Rank 0's store on a free local port (the workers connect to its .port)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)


def join_store(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=TIMEOUT)


@contextmanager
def _environment(**values: str):
    """os.environ with these values while the block runs (ProcessGroupNCCL reads its settings when made)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
