"""The engine: requests in, RequestOutputs out, one `step()` at a time.

A step flows one way: pending aborts -> scheduler -> model runner (forward + sampler) -> scheduler
(append tokens, token-level stops) -> output processor (detokenize, stop strings) -> outputs.
Everything here is synchronous and single-threaded except `abort_request`, which may be called from
any thread and takes effect at the next step boundary.
"""
from __future__ import annotations

import collections
import gc
import itertools
import logging
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from pagednb.attention.selector import select_attention_backend
from pagednb.config import EngineConfig
from pagednb.engine.block_pool import BlockPool
from pagednb.engine.kv_cache_manager import KVCacheManager
from pagednb.engine.kv_cache_sizing import plan_kv_pool
from pagednb.engine.model_runner import ModelRunner
from pagednb.engine.output_processor import OutputProcessor
from pagednb.engine.scheduler import Scheduler
from pagednb.model import ModelSpec, load_hf_config, load_model, load_tokenizer, resolve_model_path
from pagednb.outputs import RequestOutput
from pagednb.request import Request, RequestStatus
from pagednb.sampling_params import SamplingParams

logger = logging.getLogger("pagednb")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.model_path = resolve_model_path(config.model, config.revision)
        hf_config = load_hf_config(self.model_path, config.trust_remote_code)
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path, config.trust_remote_code)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        self.max_model_len = config.resolve_max_model_len(self.spec.max_position_embeddings)
        self.max_num_batched_tokens = config.resolve_max_num_batched_tokens(self.device)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, hf_config, self.model_path)
        torch.manual_seed(config.seed)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        t0 = time.perf_counter()
        self.attention_backend = select_attention_backend(self.device, config.attention_backend)
        model = load_model(self.model_path, hf_config, self.dtype, self.device, self.attention_backend)
        logger.info("Loaded %s (%s) on %s in %.1f s, attention backend %s", self.model_path.name,
                    self.spec.architecture, self.device, time.perf_counter() - t0, self.attention_backend.name)
        self.runner = ModelRunner(model, self.device, self.dtype, config.block_size, config.max_num_seqs,
                                  self.max_model_len, sorted(self.eos_token_ids), self.generator,
                                  self.max_num_batched_tokens)
        self.pool_plan = plan_kv_pool(config, self.runner, self.max_model_len, self.max_num_batched_tokens,
                                      config.max_num_seqs)
        self.runner.allocate_kv_cache(self.pool_plan.num_blocks)
        self.uses_cuda_graphs = self._capture_cuda_graphs()
        caching = config.enable_prefix_caching and self.spec.sliding_window is None
        if config.enable_prefix_caching and not caching:
            logger.info("Prefix caching is off: the model uses a sliding window")
        self.kv_cache_manager = KVCacheManager(BlockPool(self.pool_plan.num_blocks, caching), config.block_size,
                                               self.spec.sliding_window)
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                   self.max_model_len, config.scheduling_policy)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._pending_aborts: set[str] = set()
        self._in_flight: collections.deque = collections.deque()  # launched steps not yet finished
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self._abort_lock = threading.Lock()
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_computed_tokens = 0  # prompt and recomputed tokens included: all the model processed
        self.closed = False
        # Start-up promoted ~10^6 long-lived objects (torch, transformers, the model) into the oldest GC
        # generation without a full collection; serving's own survivors would then soon make one due, and it
        # walks them all: a ~250 ms pause in the middle of the first workload (benchmarks/NOTES.md). One full
        # collection here, while nothing is being served, resets that count.
        gc.collect()

    def _capture_cuda_graphs(self) -> bool:
        """Decode CUDA graphs on a GPU with pagednb's CUDA attention, unless enforce_eager."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return False
        if self.attention_backend.name != "cuda":
            logger.info("No CUDA graphs: the %s attention backend plans on the host every step",
                        self.attention_backend.name)
            return False
        try:
            self.runner.capture_decode_graphs(min(self.config.max_cuda_graph_batch_size, self.config.max_num_seqs))
        except torch.cuda.OutOfMemoryError:
            self.runner.graphs = None
            torch.cuda.empty_cache()
            logger.warning("No CUDA graphs: capturing them ran out of GPU memory. Lower gpu_memory_utilization "
                           "or max_cuda_graph_batch_size to leave room for them; steps run eagerly meanwhile")
            return False
        return True

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | Sequence[int] | dict,
                    sampling_params: SamplingParams | None = None, priority: int = 0) -> str:
        """Validates and queues a request; bad input raises ValueError and changes nothing."""
        req = self.make_request(request_id, prompt, sampling_params, priority)
        self.enqueue(req)
        return req.request_id

    def make_request(self, request_id: str | None, prompt: str | Sequence[int] | dict,
                     sampling_params: SamplingParams | None = None, priority: int = 0) -> Request:
        """Builds a checked Request without queueing it (so a batch can be checked before any is added)."""
        self._check_open()
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        self._check_prompt(token_ids)
        max_tokens = self._resolve_max_tokens(len(token_ids), params)
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.scheduler.requests or self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        return Request(request_id, token_ids, params, max_tokens, prompt=text, priority=priority,
                       arrival_index=next(self._ids), eos_token_ids=self.eos_token_ids, generator=generator)

    def enqueue(self, req: Request) -> None:
        self.output_processor.add_request(req)
        self.scheduler.add_request(req)

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Thread-safe; the request ends with finish_reason "abort" at the next step boundary."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._abort_lock:
            self._pending_aborts.update(ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending_aborts) or bool(self._in_flight)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and launches one step, then finishes the previous one (asynchronous scheduling) or
        this one (synchronous); returns the outputs of the finished step and of aborted requests.

        Asynchronous scheduling overlaps the host's work with the device's: while step N runs on the
        GPU, the host schedules and launches N+1 (its decode inputs read from N's sampled tokens on the
        device), then takes N's tokens, applies stops and builds outputs. A request stopped by N's token
        (EOS, a stop string) already has a row in N+1; that token is dropped.
        """
        self._check_open()
        aborted = self._apply_aborts()
        outputs: list[RequestOutput] = []
        overlap = self.async_scheduling and not self._needs_sync()
        if not overlap:
            outputs += self._complete_in_flight()
        sched = self.scheduler.schedule()
        self.runner.release_requests(sched.released_request_ids)
        launched = False
        if sched.scheduled:
            launched, failed = self._launch(sched)
            outputs += failed
        # keep the step just launched in flight (its tokens are read at the next call), nothing older
        outputs += self._complete_in_flight(keep=1 if overlap and launched else 0)
        self.output_processor.detokenize(aborted)
        return self.output_processor.make_outputs(aborted) + outputs

    def _needs_sync(self) -> bool:
        """A running request whose sampling reads its output so far needs the last token first."""
        return any(req.needs_output_history for req in self.scheduler.running)

    def _launch(self, sched) -> tuple[bool, list[RequestOutput]]:
        """Queues the step; (True, []) or, when the launch raised, (False, the failed requests' outputs)."""
        try:
            launched = self.runner.launch(sched)
        except Exception as error:  # the step's requests end with "error"; the engine stays usable
            return False, self._fail(sched, error)
        except BaseException:  # KeyboardInterrupt mid-launch: as if the step never ran; the caller decides
            self.scheduler.rollback(sched)
            raise
        self._in_flight.append((sched, launched))
        return True, []

    def _complete_in_flight(self, keep: int = 0) -> list[RequestOutput]:
        """Finishes launched steps, oldest first, until `keep` remain in flight."""
        outputs = []
        while len(self._in_flight) > keep:
            sched, launched = self._in_flight[0]
            try:
                token_ids, sampler_output = self.runner.collect(launched)
            except Exception as error:
                self._in_flight.popleft()
                outputs += self._fail(sched, error)
                continue
            self._in_flight.popleft()  # after the wait: an interrupted wait leaves the step to finish later
            outputs += self._process(sched, token_ids, sampler_output)
        return outputs

    def _process(self, sched, token_ids: list[int], sampler_output) -> list[RequestOutput]:
        progressed = self.scheduler.update_from_output(sched, token_ids)
        self.num_steps += 1
        self.num_generated_tokens += len(progressed)
        self.num_computed_tokens += sched.num_scheduled_tokens
        if sampler_output is not None and sampler_output.logprobs is not None:
            _record_logprobs(progressed, sampler_output, sched)
        stops = self.output_processor.detokenize(progressed)
        if stops:
            self._finish_stopped(progressed, stops)
        return self.output_processor.make_outputs(progressed)

    def _fail(self, sched, error: Exception) -> list[RequestOutput]:
        logger.error("Model step failed; its %d requests end with finish_reason 'error'. The engine can "
                     "continue: other requests are unaffected", len(sched.scheduled), exc_info=error)
        self.scheduler.rollback(sched)
        failed = self.scheduler.finish_requests([s.request.request_id for s in sched.scheduled],
                                                RequestStatus.FINISHED_ERROR)
        self.output_processor.detokenize(failed)
        return self.output_processor.make_outputs(failed, error)

    def _finish_stopped(self, progressed: list[Request], stops: dict[str, str]) -> None:
        """Requests whose text reached a stop string end as stopped (blocks freed now)."""
        for req in progressed:
            stop = stops.get(req.request_id)
            if stop is None:
                continue
            req.stop_reason = stop
            if req.status == RequestStatus.FINISHED_LENGTH_CAPPED:
                req.status = RequestStatus.FINISHED_STOPPED  # already freed; the stop string wins
        self.scheduler.finish_requests(stops, RequestStatus.FINISHED_STOPPED)

    def _apply_aborts(self) -> list[Request]:
        with self._abort_lock:
            ids, self._pending_aborts = self._pending_aborts, set()
        return self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    # ---- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict:
        pool = self.kv_cache_manager.pool
        used = pool.num_blocks - pool.num_free_blocks
        return {
            "num_blocks": pool.num_blocks,
            "block_size": self.config.block_size,
            "free_blocks": pool.num_free_blocks,
            "cached_blocks": pool.num_cached_blocks,
            "used_blocks": used,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": self.kv_cache_manager.prefix_cache_hit_tokens,
            "prefix_cache_query_tokens": self.kv_cache_manager.prefix_cache_query_tokens,
            "kv_usage": used / pool.num_blocks,
            "steps": self.num_steps,
            "generated_tokens": self.num_generated_tokens,
            "computed_tokens": self.num_computed_tokens,
        }

    def block_map(self) -> list[tuple[str, str | None]]:
        """Every block's state, in block-id order: ("used", request_id), ("cached", None) for a free
        block that still holds reusable prefix content, or ("free", None)."""
        return self.kv_cache_manager.block_map()

    def check_integrity(self) -> None:
        """Asserts the pool's invariants (free xor referenced, ref counts == holders); for tests."""
        self.kv_cache_manager.pool.check_integrity(self.kv_cache_manager.reference_counts())

    def close(self) -> None:
        """Aborts everything and gives the model and KV cache memory back."""
        if self.closed:
            return
        self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
        self._in_flight.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing may still write into the cache being freed
        self.runner.release_kv_cache()
        self.runner.model = None
        self.closed = True
        gc.collect()  # the model's modules may sit in reference cycles
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- input checks ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if getattr(self, "closed", False):
            raise RuntimeError("the engine is closed")

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _as_token_list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        return None, _as_token_list(prompt)

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it must have at least 1 token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; it must be shorter than max_model_len "
                             f"({self.max_model_len}) to leave room for output")
        vocab = self.spec.vocab_size
        ids = np.asarray(token_ids)  # one C loop: prompts of thousands of tokens arrive by the hundred
        outside = np.flatnonzero((ids < 0) | (ids >= vocab))
        if outside.size:
            bad = int(outside[0])
            raise ValueError(f"prompt_token_ids[{bad}] = {token_ids[bad]} is outside the vocabulary [0, {vocab})")

    def _resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{num_prompt_tokens + params.max_tokens} exceeds max_model_len ({self.max_model_len})")
        return params.max_tokens


def _as_token_list(token_ids) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    ids = list(token_ids)
    if ids:  # checked in one C loop: floats, bools, strings, nested lists and huge ints are refused
        try:
            array = np.asarray(ids)
        except (ValueError, TypeError):
            array = None
        if array is None or array.ndim != 1 or array.dtype.kind not in "iu":
            raise ValueError("prompt_token_ids must be a list of ints")
    return ids


def _record_logprobs(progressed: list[Request], out, sched) -> None:
    """Stores the sampled token's logprob (and the top-k) on each request that asked for them."""
    values = out.logprobs.tolist()
    top_vals = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
    row_of = {s.request.request_id: i for i, s in enumerate(s for s in sched.scheduled if s.samples)}
    for req in progressed:
        i = row_of[req.request_id]  # its row among the step's sampled rows (dropped tokens leave gaps)
        k = req.sampling_params.logprobs
        if k is None:
            continue
        entry = {req.output_token_ids[-1]: values[i]}
        if top_ids is not None:
            entry.update(zip(top_ids[i][:k], top_vals[i][:k]))
        req.logprobs.append(entry)
        req.cumulative_logprob += values[i]


def _eos_token_ids(tokenizer, hf_config, model_path) -> frozenset[int]:
    """EOS ids from the tokenizer, the model config and generation_config.json (any of them counts)."""
    ids: set[int] = set()
    candidates = [tokenizer.eos_token_id, getattr(hf_config, "eos_token_id", None)]
    try:
        from transformers import GenerationConfig
        candidates.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except (OSError, ValueError):
        pass
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
