"""Tensor parallelism over the GPUs of one host (torch.distributed: NCCL on GPUs, gloo on a CPU).

  process_group.py    the ranks and their two process groups (control messages, the model's collectives)
  parallel_layers.py  Megatron sharding of the decoder: which rank holds which rows, and the collectives
  step_broadcast.py   what rank 0 sends the workers: each step's inputs, and the few other orders
  tp_runner.py        rank 0's model runner, telling the workers what to mirror
  worker_pool.py      rank 0's handle on the worker processes: spawn, watch, end
  worker.py           a worker process: its shard, its KV pool, the loop running rank 0's steps
"""
from pagednb.distributed.worker_pool import TensorParallelError

__all__ = ["TensorParallelError"]
