"""The engine: requests in, RequestOutputs out, one `step()` at a time.

Requests are built and checked by the input processor before they are queued. A step flows one way:
pending aborts -> scheduler -> model runner (forward + sampler) -> scheduler (append tokens,
token-level stops) -> grammar matchers (structured output: a finished grammar stops its request) ->
output processor (logprobs, detokenize, stop strings) -> outputs. The one way back is a stop string:
the output processor finds it in the text, `_finish_stopped` ends the request in the scheduler before
its output is built. Everything here is synchronous and single-threaded
except `abort_request`, which may be called from any thread and takes effect at the next step boundary.
"""
from __future__ import annotations

import collections
import gc
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from pagednb.attention.kv_quant import is_fp8
from pagednb.attention.selector import select_attention_backend
from pagednb.config import EngineConfig
from pagednb.distributed.parallel_layers import check_tensor_parallel, shard_spec
from pagednb.distributed.tp_runner import TensorParallelRunner
from pagednb.distributed.worker_pool import TensorParallelError, WorkerPool, rank_devices
from pagednb.engine import live_engines
from pagednb.engine.block_pool import BlockPool
from pagednb.engine.input_processor import InputProcessor, PromptType, find_eos_token_ids
from pagednb.engine.interrupts import deferred_interrupts
from pagednb.engine.hybrid_kv_cache_manager import make_kv_cache_manager
from pagednb.engine.logits_processors import LogitsProcessors
from pagednb.engine.kv_cache_sizing import plan_kv_pool
from pagednb.engine.model_runner import ModelRunner
from pagednb.engine.output_processor import OutputProcessor
from pagednb.engine.parallel_sampling import ParentRequest
from pagednb.engine.scheduler import Scheduler
from pagednb.engine.sleep import SLEEP_LEVELS, SleepingWeights, put_to_sleep, wake
from pagednb.engine.spec_decode.drafter import MAX_DRAFT_BATCH, Drafter, max_draft_rows
from pagednb.engine.spec_decode.verifier import DraftVerifier
from pagednb.engine.step_report import StepRecorder
from pagednb.model import load_hf_config, load_model, load_tokenizer, model_spec, resolve_model_path
from pagednb.model.spec import check_start_up_memory
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
        self.spec = model_spec(hf_config)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path, config.trust_remote_code)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        self.max_model_len = config.resolve_max_model_len(self.spec.max_position_embeddings)
        self.max_num_batched_tokens = config.resolve_max_num_batched_tokens(self.device)
        check_tensor_parallel(self.spec, hf_config, config.tensor_parallel_size)
        devices = rank_devices(self.device, config.tensor_parallel_size)  # one per tensor-parallel rank
        self.device = devices[0]
        check_start_up_memory(shard_spec(self.spec, config.tensor_parallel_size), config, self.dtype, self.device,
                              self.max_model_len, self.max_num_batched_tokens)  # before any allocation: a clear error
        self.eos_token_ids = find_eos_token_ids(self.tokenizer, hf_config, self.model_path)
        torch.manual_seed(config.seed)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        kv_cache_dtype = config.resolve_kv_cache_dtype(self.dtype)
        self.attention_backend = select_attention_backend(
            self.device, config.attention_backend,
            fp8_cache_in_float32=is_fp8(kv_cache_dtype) and self.dtype == torch.float32)
        self.spec_config = config.resolve_speculative_config()
        # tensor parallel: ranks 1.. in spawned processes, loading their shards while this one loads its own
        self.workers = (WorkerPool.start(replace(config, model=str(self.model_path)), devices,
                                         self.attention_backend.name) if len(devices) > 1 else None)
        try:
            self._load_model(hf_config, kv_cache_dtype)
        except BaseException:
            if self.workers is not None:
                self.workers.close()
            raise
        caching = config.enable_prefix_caching and self.spec.sliding_window is None
        if config.enable_prefix_caching and not caching:
            logger.info("Prefix caching is off: the model uses a sliding window")
        self.kv_cache_manager = make_kv_cache_manager(BlockPool(self.pool_plan.num_blocks, caching),
                                                      config.block_size, self.runner.layout)
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                   self.max_model_len, config.scheduling_policy)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor = InputProcessor(self.tokenizer, self.spec.vocab_size, self.max_model_len,
                                              self.eos_token_ids, self.device, self._is_request_id_in_use)
        # logit_bias, allowed_token_ids, bad_words, structured outputs (xgrammar, loaded at first use)
        self.logits_processors = LogitsProcessors(self.tokenizer, self.spec.vocab_size, sorted(self.eos_token_ids))
        self.runner.logits_processors = self.logits_processors
        self._pending_aborts: set[str] = set()
        self._in_flight: collections.deque = collections.deque()  # launched steps not yet finished
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self.drafter, self.verifier = self._start_spec_decode()
        self._abort_lock = threading.RLock()  # reentrant: a stream collected mid-swap aborts from its __del__
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_computed_tokens = 0  # prompt and recomputed tokens included: all the model processed
        self.closed = False
        self._sleeping: SleepingWeights | None = None  # set while asleep (engine/sleep.py)
        self.step_recorder: StepRecorder | None = None  # set while a step debugger listens (engine/step_report.py)
        # Start-up promoted ~10^6 long-lived objects (torch, transformers, the model) into the oldest GC
        # generation without a full collection; serving's own survivors would then soon make one due, and it
        # walks them all: a ~250 ms pause in the middle of the first workload (benchmarks/NOTES.md). One full
        # collection here, while nothing is being served, resets that count.
        gc.collect()

    def _load_model(self, hf_config, kv_cache_dtype: torch.dtype) -> None:
        """The weights (this rank's shard with tensor parallelism), the KV pool and the CUDA graphs."""
        config, t0 = self.config, time.perf_counter()
        tp = self.workers.group if self.workers is not None else None
        model = load_model(self.model_path, hf_config, self.spec, self.dtype, self.device, self.attention_backend,
                           config.load_format, tp=tp)
        logger.info("Loaded %s (%s) on %s in %.1f s, attention backend %s", self.model_path.name,
                    self.spec.architecture, self.device, time.perf_counter() - t0, self.attention_backend.name)
        runner_args = (model, self.device, self.dtype, config.block_size, config.max_num_seqs, self.max_model_len,
                       sorted(self.eos_token_ids), self.generator, self.max_num_batched_tokens, kv_cache_dtype,
                       max_draft_rows(config, self.spec_config))
        self.runner = (ModelRunner(*runner_args) if self.workers is None
                       else TensorParallelRunner(self.workers, *runner_args))
        self.pool_plan = plan_kv_pool(config, self.runner, self.max_model_len, self.max_num_batched_tokens,
                                      config.max_num_seqs)
        self.runner.allocate_kv_cache(self.pool_plan.num_blocks)
        live_engines.register(self, config.model, self.device, live_engines.parameter_bytes(model),
                              live_engines.tensor_bytes(self.runner.kv_cache_tensors))  # named by later engines' reports
        self.uses_cuda_graphs = self._capture_cuda_graphs()

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

    def _start_spec_decode(self) -> tuple[Drafter | None, DraftVerifier | None]:
        """Speculative decoding's two halves, or (None, None) when it is off. Drafts are proposed from the
        tokens known on the host, so while drafting a step must have its tokens before the next is scheduled:
        steps are synchronous then (needs_sync), as early vLLM ran speculative decoding. Under load no drafts
        are proposed and asynchronous scheduling runs as without speculative decoding."""
        spec = self.spec_config
        if spec is None:
            return None, None
        logger.info("Speculative decoding: %s, up to %d draft tokens per step (n-grams of %d-%d tokens); with at "
                    "most %d requests running, steps are synchronous and drafted; above that, no drafts%s",
                    spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                    MAX_DRAFT_BATCH, " and asynchronous scheduling as usual" if self.async_scheduling else "")
        return Drafter(spec, self.max_model_len), DraftVerifier()

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: PromptType, sampling_params: SamplingParams | None = None,
                    priority: int = 0) -> str:
        """Validates and queues a request; bad input raises ValueError and changes nothing."""
        req = self.make_request(request_id, prompt, sampling_params, priority)
        self.enqueue(req)
        return req.request_id

    def make_request(self, request_id: str | None, prompt: PromptType, sampling_params: SamplingParams | None = None,
                     priority: int = 0) -> Request | ParentRequest:
        """Builds a checked Request without queueing it (so a batch can be checked before any is added);
        with SamplingParams.n > 1 a ParentRequest of n children (engine/parallel_sampling.py)."""
        self._check_open()
        self._check_awake()
        req = self.input_processor.make_request(request_id, prompt, sampling_params, priority)
        for one in req.children if isinstance(req, ParentRequest) else (req,):
            self.logits_processors.prepare(one)  # vocabulary checks, bad-word tokens, grammar compiled (ValueError)
        return req

    def enqueue(self, req: Request | ParentRequest) -> None:
        """Queues a request from make_request (with n > 1, its n children side by side)."""
        self._check_awake()
        self.output_processor.add_request(req)
        for one in req.children if isinstance(req, ParentRequest) else (req,):
            self.logits_processors.register(one)
            self.scheduler.add_request(one)

    def _is_request_id_in_use(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests or self.output_processor.has_request(request_id)

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Thread-safe; the request ends with finish_reason "abort" at the next step boundary."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._abort_lock:
            self._pending_aborts.update(ids)

    @property
    def num_steps_launched(self) -> int:
        """Steps launched so far: the finished ones (num_steps, stats()["steps"]) and, under asynchronous
        scheduling, the one still in flight, whose tokens the next step reads."""
        return self.num_steps + len(self._in_flight)

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

        Ctrl-C waits for the step's end (engine/interrupts.py): a step is never left half-done.
        """
        self._check_open()
        recorder = self.step_recorder
        with deferred_interrupts():
            if recorder is not None:
                recorder.begin(self)
            aborted = self._apply_aborts()
            outputs: list[RequestOutput] = []
            overlap = self.async_scheduling and not self.needs_sync
            if not overlap:
                outputs += self._complete_in_flight()
            if self.drafter is not None and not overlap:  # every token is known now
                self.drafter.propose(self.scheduler.running)
            sched = self.scheduler.schedule()
            if recorder is not None:
                recorder.scheduled(self, sched)
            self.runner.release_requests(sched.released_request_ids)
            if self.drafter is not None:
                self.drafter.forget(sched.released_request_ids)
            launched = False
            if sched.scheduled:
                launched, failed = self._launch(sched)
                outputs += failed
            # keep the step just launched in flight (its tokens are read at the next call), nothing older
            outputs += self._complete_in_flight(keep=1 if overlap and launched else 0)
            outputs = self.output_processor.process(aborted) + outputs
            if recorder is not None:
                recorder.end(self, outputs)
            return outputs

    @property
    def needs_sync(self) -> bool:
        """Whether the next step runs synchronously: a running request's sampling reads its output so
        far (penalties, min_tokens, bad_words), so it needs the last token first, or
        speculative decoding may draft (few requests run: drafts are proposed from every token so far).
        Tells why steps don't overlap."""
        running = self.scheduler.running
        return ((self.drafter is not None and len(running) <= MAX_DRAFT_BATCH)
                or any(req.needs_output_history for req in running))

    def _launch(self, sched) -> tuple[bool, list[RequestOutput]]:
        """Queues the step; (True, []) or, when the launch raised, (False, the failed requests' outputs)."""
        try:
            if sched.num_draft_tokens:
                self.verifier.before_sampling(sched)
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
            if len(self._in_flight) == 1:  # the matchers have every token before the newest step now
                self.runner.start_grammar_fill(self._in_flight[0][1])
        return outputs

    def _process(self, sched, token_ids: list[int], sampler_output) -> list[RequestOutput]:
        num_accepted = None
        if sched.num_draft_tokens:  # one token per verify row: each request's accepted run (spec_decode/)
            token_ids, num_accepted, sampler_output = self.verifier.accept(sched, token_ids, sampler_output)
        progressed = self.scheduler.update_from_output(sched, token_ids, num_accepted)
        self._advance_grammars(progressed)
        self.num_steps += 1
        self.num_generated_tokens += len(progressed) + (sum(num_accepted) if num_accepted else 0)
        self.num_computed_tokens += sched.num_scheduled_tokens
        self.output_processor.record_logprobs(progressed, sampler_output, sched)
        return self.output_processor.process(self._with_failed_siblings(progressed), self._finish_stopped)

    def _advance_grammars(self, progressed: list[Request]) -> None:
        """Feeds structured-output matchers their new tokens: a rejected token ends that request alone with
        "error", a grammar that reached its end ends it as "stop" (blocks freed now, before its output)."""
        rejected, terminated = self.logits_processors.advance(progressed)
        if rejected:
            self.scheduler.finish_requests([r.request_id for r in rejected], RequestStatus.FINISHED_ERROR)
        if terminated:
            self.scheduler.finish_requests([r.request_id for r in terminated], RequestStatus.FINISHED_STOPPED)

    def _fail(self, sched, error: Exception) -> list[RequestOutput]:
        if isinstance(error, TensorParallelError):
            raise error  # the ranks are out of step: the engine stops (the driver ends every request with it)
        logger.error("Model step failed; its %d requests end with finish_reason 'error'. The engine can "
                     "continue: other requests are unaffected", len(sched.scheduled), exc_info=error)
        self.scheduler.rollback(sched)
        failed = self.scheduler.finish_requests([s.request.request_id for s in sched.scheduled],
                                                RequestStatus.FINISHED_ERROR)
        return self.output_processor.process(self._with_failed_siblings(failed), error=error)

    def _with_failed_siblings(self, reqs: list[Request]) -> list[Request]:
        """reqs, plus the siblings (aborted now) of n > 1 children that failed: one child's error ends
        its parent request with that error."""
        parents = self.output_processor.parents
        ids = parents.siblings_to_abort(reqs) if parents else None
        if not ids:
            return reqs
        aborted = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        listed = set(reqs)  # a sibling that advanced this step is listed already (now aborted)
        return reqs + [req for req in aborted if req not in listed]

    def _finish_stopped(self, stopped: list[tuple[Request, str]]) -> None:
        """The one way back from the output processor to the scheduler: requests whose text reached a
        stop string end as stopped (blocks freed now), before their outputs are built."""
        for req, stop in stopped:
            req.stop_reason = stop
            if req.status == RequestStatus.FINISHED_LENGTH_CAPPED:
                req.status = RequestStatus.FINISHED_STOPPED  # already freed; the stop string wins
        self.scheduler.finish_requests([req.request_id for req, _ in stopped], RequestStatus.FINISHED_STOPPED)

    def _apply_aborts(self) -> list[Request]:
        with self._abort_lock:
            ids, self._pending_aborts = self._pending_aborts, set()
        parents = self.output_processor.parents
        if parents and ids:  # an n > 1 request's id aborts its n children
            ids = parents.expand(ids)
        return self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    # ---- sleep mode --------------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self._sleeping is not None

    def sleep(self, level: int = 1) -> None:
        """Frees the device for other work while idle: level 1 moves the weights to (pinned) CPU memory,
        level 2 drops them (reloaded from the checkpoint on waking); both free the KV pool and reset the
        prefix cache. As vLLM, it expects an idle engine: unfinished requests refuse it. Asleep already:
        nothing happens."""
        self._check_open()
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ValueError(f"level must be 1 ({SLEEP_LEVELS[1]}) or 2 ({SLEEP_LEVELS[2]}), got {level!r}")
        if self.is_sleeping:
            return
        if self.workers is not None:
            raise NotImplementedError(f"sleep mode is not supported with tensor_parallel_size="
                                      f"{self.config.tensor_parallel_size}: close() the LLM to free its GPUs")
        self._check_idle()
        with deferred_interrupts():
            self._complete_in_flight()  # a step launched for requests that finished since: tokens dropped
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            pool = self.kv_cache_manager.pool
            pool.forget(pool.blocks)  # the cache's content goes with the pool
            self.runner.kv_caches.clear()
            self.runner.release_kv_cache()  # the CUDA graphs too: they hold the cache's addresses
            self.runner.forget_last_sampled()
            self._sleeping = put_to_sleep(self.runner.model, level)
            live_engines.unregister(self)  # holds nothing on the device now: later engines' reports say so
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("Asleep (level %d): %s", level, SLEEP_LEVELS[level])

    def wake_up(self) -> None:
        """Restores the weights (same dtype and device), a KV pool of the same size and the decode CUDA
        graphs (recaptured: the old ones held freed addresses). Awake already: nothing happens."""
        self._check_open()
        if self._sleeping is None:
            return
        with deferred_interrupts():
            wake(self.runner.model, self._sleeping, self.device, self.model_path)
            self.runner.allocate_kv_cache(self.pool_plan.num_blocks)
            if self.uses_cuda_graphs:
                self.uses_cuda_graphs = self._capture_cuda_graphs()
            live_engines.register(self, self.config.model, self.device,
                                  live_engines.parameter_bytes(self.runner.model),
                                  live_engines.tensor_bytes(self.runner.kv_cache_tensors))
            self._sleeping = None
        logger.info("Awake: weights and a KV pool of %d blocks restored", self.pool_plan.num_blocks)

    def _check_idle(self) -> None:
        scheduler = self.scheduler
        if scheduler.has_unfinished_requests():
            raise RuntimeError(
                f"cannot sleep with {len(scheduler.requests)} unfinished requests ({len(scheduler.running)} "
                f"running, {len(scheduler.waiting)} waiting; an n > 1 request counts n): as in vLLM, the engine "
                f"must be idle. Let them finish, or abort them (llm.abort(request_id)) first")

    def _check_awake(self) -> None:
        if self.is_sleeping:
            raise RuntimeError(f"the engine is asleep (sleep level {self._sleeping.level}): "
                               f"call llm.wake_up() before generating")

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
            **(self._spec_decode_stats() if self.verifier is not None else {}),
        }

    def _spec_decode_stats(self) -> dict:
        """Speculative decoding's counters, named as vLLM's spec-decode metrics."""
        verifier = self.verifier
        return {"spec_decode_num_drafts": verifier.num_drafts,
                "spec_decode_num_draft_tokens": verifier.num_draft_tokens,
                "spec_decode_num_accepted_tokens": verifier.num_accepted_tokens,
                "spec_decode_mean_acceptance_length": verifier.mean_acceptance_length}

    def block_map(self) -> list[tuple[str, str | None]]:
        """Every block's state, in block-id order: ("used", request_id), ("cached", None) for a free
        block that still holds reusable prefix content, or ("free", None)."""
        return self.kv_cache_manager.block_map()

    def check_integrity(self) -> None:
        """Asserts the pool's invariants (free xor referenced, ref counts == holders); for tests."""
        self.kv_cache_manager.pool.check_integrity(self.kv_cache_manager.reference_counts())

    def close(self) -> None:
        """Aborts everything and gives the model and KV cache memory back."""
        with deferred_interrupts():
            if self.closed:
                return
            self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
            self._in_flight.clear()
            if self.workers is not None:  # first: a collective a dead worker never joined is aborted, not awaited
                self.workers.close()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # nothing may still write into the cache being freed
            self.runner.kv_caches.clear()  # in place: a traceback's frame may still hold the list
            self.runner.release_kv_cache()
            live_engines.unregister(self)
            self.runner.model = None
            self.logits_processors.close()
            self.closed = True
        gc.collect()  # the model's modules may sit in reference cycles
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if getattr(self, "closed", False):
            raise RuntimeError("the engine is closed")
