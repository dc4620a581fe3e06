"""A worker process of a tensor-parallel engine (ranks 1..N-1): its shard of the model and of every KV
block, and a loop doing what rank 0 says (step_broadcast.Op) until told to stop.

A worker never schedules, samples or detokenizes: it runs the forward of each step rank 0 sends, so
that the collectives inside it (the row-parallel all-reduces, the vocabulary gathers) have every rank.
It sizes nothing on its own either: the KV pool's block count and the CUDA graphs' buckets come from
rank 0. Any error ends the process, after leaving its traceback in the store for rank 0 to report.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import traceback

import torch

from pagednb.attention.backend import AttentionMetadata
from pagednb.attention.kv_quant import is_fp8
from pagednb.attention.selector import select_attention_backend
from pagednb.config import EngineConfig
from pagednb.distributed.process_group import TensorParallelGroup, join_store
from pagednb.distributed.step_broadcast import Op, StepReceiver, host_lengths
from pagednb.distributed.worker_pool import CONFIG_KEY, ERROR_KEY
from pagednb.engine.kv_cache_sizing import plan_kv_pool
from pagednb.engine.model_runner import ModelRunner
from pagednb.engine.spec_decode.drafter import max_draft_rows
from pagednb.model import load_hf_config, load_model, model_spec, resolve_model_path


def main(argv: list[str]) -> None:
    """`python -m pagednb.distributed.worker RANK WORLD_SIZE STORE_PORT DEVICE` (worker_pool.py starts it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is rank 0's to handle
    rank, world_size, port, device = int(argv[0]), int(argv[1]), int(argv[2]), torch.device(argv[3])
    logging.getLogger("pagednb").setLevel(logging.WARNING)  # rank 0 reports the start-up
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks share the host's cores (and OpenMP's idle threads spin: more would starve the others)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = join_store(port, world_size)
    try:
        tp = TensorParallelGroup(rank, world_size, device)
        worker = Worker(pickle.loads(store.get(CONFIG_KEY)), tp)  # loads its shard while rank 0 loads its own
        store.set(f"joining/{rank}", "1")
        tp.connect(store)
        worker.serve()
    except BaseException:
        store.set(ERROR_KEY.format(rank=rank), traceback.format_exc())
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # told to stop: nothing left to tear down that the OS does not (saves ~2 s of interpreter exit)


class Worker:
    def __init__(self, config: EngineConfig, tp: TensorParallelGroup) -> None:
        self.config, self.tp, device = config, tp, tp.device
        path = resolve_model_path(config.model, config.revision)
        hf_config = load_hf_config(path, config.trust_remote_code)
        spec = model_spec(hf_config)
        dtype = config.resolve_dtype(device)
        self.max_model_len = config.resolve_max_model_len(spec.max_position_embeddings)
        self.max_num_batched_tokens = config.resolve_max_num_batched_tokens(device)
        torch.manual_seed(config.seed)
        kv_cache_dtype = config.resolve_kv_cache_dtype(dtype)
        backend = select_attention_backend(device, config.attention_backend,
                                           fp8_cache_in_float32=is_fp8(kv_cache_dtype) and dtype == torch.float32)
        model = load_model(path, hf_config, spec, dtype, device, backend, config.load_format, tp=tp)
        self.runner = ModelRunner(model, device, dtype, config.block_size, config.max_num_seqs, self.max_model_len,
                                  [], None, self.max_num_batched_tokens, kv_cache_dtype,
                                  max_draft_rows(config, config.resolve_speculative_config()))
        self.runner.tensor_parallel = tp
        self.receiver = StepReceiver(tp, self.runner.buffers)

    @torch.inference_mode()
    def serve(self) -> None:
        while True:
            op, args = self.receiver.receive_op()
            if op == Op.STEP:
                self.step(args)
            elif op == Op.PROFILE_KV_POOL:  # the same sizing as rank 0, whose pool is the least any rank affords
                plan_kv_pool(self.config, self.runner, self.max_model_len, self.max_num_batched_tokens,
                             self.config.max_num_seqs)
            elif op == Op.ALLOCATE_KV_CACHE:
                self.runner.allocate_kv_cache(args[0])
            elif op == Op.CAPTURE_GRAPHS:
                self.runner.capture_decode_graphs(args[0], progress=False)
            elif op == Op.SHUTDOWN:
                return

    def step(self, args: list[int]) -> None:
        """The forward rank 0 runs for this step, and its LM-head calls, on this rank's shard."""
        shape, v, prompt_rows = self.receiver.receive_step(args)
        runner, model = self.runner, self.runner.model
        if shape.graph_size:
            runner.graphs.replay(shape.graph_size)
            return
        qsl, seq_lens, max_query_len, max_seq_len = host_lengths(v)
        metadata = AttentionMetadata(
            slot_mapping=v.slot_mapping, query_start_loc=v.query_start_loc, seq_lens=v.seq_lens,
            block_tables=v.block_tables, max_query_len=max_query_len, max_seq_len=max_seq_len,
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
        if runner.hybrid:
            runner._add_layer_metadata(metadata, v)
        hidden = model(v.input_ids, v.positions, runner.kv_caches, metadata)
        if prompt_rows:
            model.compute_logits(hidden[torch.tensor(prompt_rows, device=hidden.device)])
        if shape.num_sampled:
            model.compute_logits(hidden[v.logits_indices])


if __name__ == "__main__":
    main(sys.argv[1:])
