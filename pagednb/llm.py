"""`LLM`: the offline entry point. Batch generation and chat on top of the step-wise engine."""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path

from pagednb.chat_template import apply_chat_template, check_chat_template
from pagednb.config import EngineConfig
from pagednb.engine.driver import EngineDriver
from pagednb.engine.input_processor import PromptType
from pagednb.engine.interrupts import deferred_interrupts
from pagednb.engine.llm_engine import LLMEngine
from pagednb.engine.prefix_cache_snapshot import PrefixCacheSnapshot, snapshot_prefix_cache
from pagednb.engine.step_report import StepReport
from pagednb.metrics import Metric, metrics_from_stats
from pagednb.outputs import RequestOutput
from pagednb.sampling_params import RequestOutputKind, SamplingParams
from pagednb.streams import RequestStream
from pagednb.vllm_compat import check_vllm_option, is_vllm_option

# A tiny story-telling Llama trained by tools/train_tiny_model.py, shipped so everything runs offline.
DEFAULT_MODEL = Path(__file__).parent / "default_model"


class LLM:
    """A model with its paged KV cache, ready to generate.

    `model`: a local folder or a hub id; None loads the embedded tiny model. The keyword options are
    the fields of `pagednb.config.EngineConfig`, with its defaults (dtype, device, block_size,
    max_model_len, max_num_seqs, enable_prefix_caching, ...; `help(LLM)` shows them all).

    >>> llm = LLM()  # the embedded tiny model; or LLM("path/or/hub-id", max_model_len=4096)
    >>> llm.generate("Tell me a story.", SamplingParams(max_tokens=64))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **options) -> None:
        self._servers: list = []  # OpenAI servers started by serve(), stopped by close()
        self.engine = LLMEngine(_engine_config(model, options))
        self.driver = EngineDriver(self.engine)

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order.

        All prompts are checked before any is queued, so a bad one raises without side effects. An
        interrupt (KeyboardInterrupt) aborts this call's requests and leaves the engine usable. A request
        that fails while running (finish_reason "error") does not stop the others: they run to the end,
        then the first failed request's error is raised, with a note naming every failed request and
        `.outputs` holding all the outputs (vLLM returns them instead; pagednb does not fail silently).
        """
        prompts = _as_prompt_list(prompts)
        params = _broadcast("sampling_params", sampling_params, len(prompts))
        priorities = _broadcast("priority", priority if priority is not None else 0, len(prompts))
        requests = []
        for i, (prompt, p, prio) in enumerate(zip(prompts, params, priorities)):
            p = _checked_params(p, f"sampling_params[{i}]" if isinstance(sampling_params, (list, tuple))
                                else "sampling_params")
            p.output_kind = RequestOutputKind.FINAL_ONLY  # nobody watches intermediate outputs here
            requests.append(self.engine.make_request(None, prompt, p, prio))
        return self._run_to_completion(requests, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             *, add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to one conversation or a list of them, then generates.
        A message is {"role": str, "content": str or a list of parts}; a malformed one raises naming its
        index (messages[i], or messages[c][i] in a batch) before anything is queued."""
        conversations = _as_conversation_list(messages)
        tokenizer = self.engine.tokenizer
        check_chat_template(tokenizer)  # also for an empty list of conversations
        prompts = [{"prompt_token_ids": apply_chat_template(tokenizer, conversation, add_generation_prompt,
                                                            chat_template_kwargs, name)}
                   for name, conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run_to_completion(self, requests: list, use_tqdm: bool) -> list[RequestOutput]:
        """Steps the engine on this thread until these requests finish. Background streams keep
        receiving their outputs meanwhile (every step goes through the driver)."""
        finals: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(requests), use_tqdm)

        def collect(out: RequestOutput) -> None:
            if out.finished:
                finals[out.request_id] = out
                if bar is not None:
                    bar.update(1)

        self.driver.check_not_paused()  # before submitting: a paused engine would never finish them here
        ids = [req.request_id for req in requests]
        # Ctrl-C is held back while requests are submitted and while ours are aborted, and takes effect
        # between two steps (run_until): it can never leave a request of ours behind.
        with deferred_interrupts():
            try:
                for req in requests:
                    self.driver.submit(req, collect)
                self.driver.run_until(lambda: len(finals) == len(ids))
            except BaseException:  # KeyboardInterrupt included: abort what is ours, keep the engine usable
                self._abort_unfinished([r for r in ids if r not in finals])
                raise
            finally:
                if bar is not None:
                    bar.close()
        outputs = [finals[r] for r in ids]
        if any(out.error is not None for out in outputs):
            raise _batch_error(outputs)
        return outputs

    def _abort_unfinished(self, request_ids: list[str]) -> None:
        """Aborts the given requests and runs the step that applies it (their blocks come back)."""
        if not request_ids or self.engine.closed or self.driver.dead is not None:
            return
        self.driver.abort(request_ids)
        self.driver.step()

    # ---- async ---------------------------------------------------------------------------------
    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None, *,
               request_id: str | None = None, priority: int = 0) -> RequestStream:
        """`async for out in llm.stream(prompt)`: outputs as tokens arrive (`.outputs[0].text` so far,
        `.outputs[0].delta` the new piece). Needs a running event loop (any notebook cell has one); the
        engine loop then runs as a background task on it, shared by every stream. Leaving the loop early
        (`break`, an error, a cancelled task) aborts the request; `async with llm.stream(...) as s:`
        aborts it whenever the block is left."""
        self.driver.ensure_background_loop()
        req = self.engine.make_request(request_id, prompt, sampling_params, priority)
        stream = RequestStream(self.driver, req.request_id, owner=self)
        stream.start(req)
        return stream

    async def agenerate(self, prompt: PromptType, sampling_params: SamplingParams | None = None, *,
                        request_id: str | None = None, priority: int = 0) -> RequestOutput:
        """`await llm.agenerate(prompt)`: the final output, while the loop stays free for other work."""
        params = _checked_params(sampling_params, "sampling_params")
        params.output_kind = RequestOutputKind.FINAL_ONLY
        final = None
        async for out in self.stream(prompt, params, request_id=request_id, priority=priority):
            final = out
        return final

    def abort(self, request_id: str) -> None:
        """Cancels a request from anywhere (a widget callback on another thread too); its stream ends
        with finish_reason "abort" at the next step boundary and its blocks return to the pool."""
        self.driver.abort(request_id)

    # ---- serving ---------------------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
              model_name: str | None = None):
        """Serves this LLM over OpenAI's API (`pip install "pagednb[serve]"`) and returns the running
        `pagednb.serving.server.Server` at once (`.url`, `.stop()`). In a notebook it runs as a task on
        the kernel's loop, sharing this engine with the cells' own calls; `close()` stops it. With an
        `api_key`, clients must send it; binding anything but loopback without one logs a warning."""
        from pagednb.serving.server import Server, announce

        server = Server(self, host, port, api_key, model_name).start()
        self._servers.append(server)
        announce(server)
        return server

    # ---- engine state ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Pool and scheduler counters: blocks used/free/cached, running/waiting, preemptions, hits."""
        return self.engine.stats()

    def get_metrics(self) -> list[Metric]:
        """vLLM's shape of stats(): a list of Counter and Gauge objects (name "pagednb:<stats key>", value,
        labels {"model_name": ...}); see pagednb/metrics.py."""
        return metrics_from_stats(self.engine.stats(), {"model_name": self.engine.config.model})

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine underneath: the same object as `llm.engine`."""
        return self.engine

    # ---- sleep mode ------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Gives the GPU back while this LLM is idle (train, plot, run another model in the same kernel):
        level 1 moves the weights to pinned CPU memory and frees the KV pool; level 2 drops the weights
        too (reloaded from the checkpoint by `wake_up`). Unfinished requests refuse it (RuntimeError), as
        vLLM expects an idle engine; while asleep, generate/chat/stream raise until `wake_up()`."""
        with deferred_interrupts(), self.driver._step_lock:  # no step may run while the weights move
            self.driver._check_alive()
            self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores the weights, a KV pool of the same size and the CUDA graphs; outputs are as before.
        `tags` (vLLM's, to wake the weights before the KV cache) is accepted only as None or all of them:
        pagednb wakes everything at once."""
        if tags is not None and sorted(set(tags)) != ["kv_cache", "weights"]:
            raise ValueError(f"pagednb does not support waking in parts: tags must be None or both 'weights' "
                             f"and 'kv_cache', got {tags!r}")
        with deferred_interrupts(), self.driver._step_lock:
            self.driver._check_alive()
            self.engine.wake_up()

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output a request may have."""
        return self.engine.max_model_len

    # ---- the step debugger (pagednb.notebook.step_view draws these) ----------------------------
    def pause(self) -> None:
        """Stops background stepping after the step under way. Requests still queue (streams wait);
        `debug_step()` advances one step; `resume()` goes back to normal. A synchronous generate()/chat()
        raises RuntimeError while paused (it would hold the kernel that the Step click needs)."""
        self.driver.pause()

    def resume(self) -> None:
        self.driver.resume()

    @property
    def paused(self) -> bool:
        return self.driver.paused

    def debug_step(self) -> StepReport:
        """Runs one engine step (outputs go to their streams as usual) and returns what the scheduler
        decided: the batch, the token budget, blocks allocated / hit / freed, preemptions and why."""
        return self.driver.debug_step()

    def on_step(self, listener: Callable[[StepReport], None]) -> Callable[[], None]:
        """Calls listener(report) after every step (on the stepping thread); returns the function that
        stops it. Steps cost a little more while anyone listens, nothing otherwise."""
        self.driver.add_step_listener(listener)
        return lambda: self.driver.remove_step_listener(listener)

    def prefix_cache_snapshot(self) -> PrefixCacheSnapshot:
        """The prefix cache's blocks as a tree of shared prefixes: ref counts, eviction order, tokens."""
        with self.driver._step_lock:  # never half a step's changes
            return snapshot_prefix_cache(self.engine.kv_cache_manager.pool, self.engine.config.block_size)

    def block_map(self) -> list[tuple[str, str | None]]:
        """Each KV block's state in block-id order: ("used", owning request id), ("cached", None) or
        ("free", None). What the notebook's pool view draws."""
        return self.engine.block_map()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stops the engine loop, aborts every request, and frees the model and KV cache memory (also
        while other references to this LLM remain, say in a notebook's output history); stops its servers."""
        servers, self._servers = self._servers, []
        try:
            self.driver.close()  # first: every request under way ends, so their responses end too
        finally:
            for server in servers:
                server.stop()

    def __del__(self) -> None:
        """`del llm`, or re-running `llm = LLM(...)`, gives the memory back at once (streams keep their
        LLM alive, so none is running by then)."""
        driver = getattr(self, "driver", None)  # None when __init__ failed
        if driver is not None:
            try:
                driver.close()
            except Exception:  # interpreter shutdown: nothing left to give back
                pass

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _batch_error(outputs: list[RequestOutput]) -> BaseException:
    """The first failed request's error, carrying every output of the batch (`error.outputs`, in input
    order) and a note naming each failed request and its error."""
    failed = [out for out in outputs if out.error is not None]
    error = failed[0].error
    error.outputs = outputs
    listed = "; ".join(f"{out.request_id}: {out.error!r}" for out in failed)
    error.add_note(f"{len(failed)} of {len(outputs)} requests failed ({listed}); the other requests finished, and "
                   f"this exception's .outputs holds every RequestOutput in input order")
    return error


def _as_prompt_list(prompts) -> list:
    """One prompt (text, token ids, a prompt dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"prompts must be a str, a list of token ids, a dict with 'prompt' or 'prompt_token_ids', "
                        f"or a list of those, got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _checked_params(params, name: str) -> SamplingParams:
    """A private, checked copy of the caller's SamplingParams (None: the defaults)."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{name} must be a SamplingParams (or a list of them, one per prompt) or None, "
                        f"got {type(params).__name__}")
    return params.clone()


def _as_conversation_list(messages) -> list[tuple[str, list]]:
    """(name for errors, conversation) for one conversation (a list of message dicts) or a list of them."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of message dicts (one conversation) or a list of such lists, "
                        f"got {type(messages).__name__}")
    if messages and isinstance(messages[0], dict):
        return [("messages", messages)]
    return [(f"messages[{i}]", conversation) for i, conversation in enumerate(messages)]


def _broadcast(name: str, value, n: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but there are {n} prompts; give one, or one per prompt")
        return list(value)
    return [value] * n


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)


_OPTIONS = [field for field in dataclasses.fields(EngineConfig) if field.name != "model"]


def _engine_config(model: str | None, options: dict) -> EngineConfig:
    """EngineConfig from LLM's arguments; a misspelt option raises TypeError as Python would, listing
    the accepted ones; a vLLM option pagednb lacks raises ValueError naming it, unless its value asks for
    nothing (pipeline_parallel_size=1): then it is ignored (pagednb/vllm_compat.py)."""
    names = [field.name for field in _OPTIONS]
    for name in [name for name in options if name not in names and is_vllm_option(name)]:
        check_vllm_option(name, options.pop(name))  # a harmless value is dropped; any other raises
    unknown = [name for name in options if name not in names]
    if unknown:
        raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}; it takes model and "
                        f"{', '.join(names)} (the fields of pagednb.config.EngineConfig)")
    return EngineConfig(model=model if model is not None else str(DEFAULT_MODEL), **options)


def _signature() -> inspect.Signature:
    """LLM(model=None, *, <EngineConfig's fields with their defaults>): what help() and a notebook's
    tooltip show, so the options stay discoverable though `__init__` takes **options."""
    model = inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation="str | None")
    return inspect.Signature([model] + [
        inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default, annotation=field.type)
        for field in _OPTIONS])


LLM.__signature__ = _signature()
