"""`LLM`: the offline entry point. Batch generation and chat on top of the step-wise engine."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pagednb.config import EngineConfig
from pagednb.engine.llm_engine import LLMEngine
from pagednb.outputs import RequestOutput
from pagednb.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | Sequence[int] | dict
# A tiny story-telling Llama trained by tools/train_tiny_model.py, shipped so everything runs offline.
DEFAULT_MODEL = Path(__file__).parent / "default_model"


class LLM:
    """A model with its paged KV cache, ready to generate.

    >>> llm = LLM()  # the embedded tiny model; or LLM("path/or/hub-id")
    >>> llm.generate("Tell me a story.", SamplingParams(max_tokens=64))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 block_size: int = 16, max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 num_kv_blocks: int | None = None, scheduling_policy: str = "fcfs", seed: int = 0,
                 kv_cache_memory: int | None = None, gpu_memory_utilization: float = 0.9,
                 trust_remote_code: bool = False, revision: str | None = None, tokenizer: str | None = None,
                 attention_backend: str = "auto"):
        self.engine = LLMEngine(EngineConfig(
            model=str(model if model is not None else DEFAULT_MODEL), dtype=dtype, device=device, block_size=block_size, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, num_kv_blocks=num_kv_blocks,
            scheduling_policy=scheduling_policy, seed=seed, kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization, trust_remote_code=trust_remote_code,
            revision=revision, tokenizer=tokenizer, attention_backend=attention_backend))

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order.

        All prompts are checked before any is queued, so a bad one raises without side effects. An
        interrupt (KeyboardInterrupt) aborts this call's requests and leaves the engine usable.
        """
        prompts = _as_prompt_list(prompts)
        params = _broadcast("sampling_params", sampling_params or SamplingParams(), len(prompts))
        priorities = _broadcast("priority", list(priority) if priority is not None else 0, len(prompts))
        engine = self.engine
        requests = []
        for prompt, p, prio in zip(prompts, params, priorities):
            p = p.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY  # nobody watches intermediate outputs here
            requests.append(engine.make_request(None, prompt, p, prio))
        for req in requests:
            engine.enqueue(req)
        return self._run_to_completion([req.request_id for req in requests], use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             *, add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to one conversation or a list of them, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        prompts = [{"prompt_token_ids": _chat_token_ids(tokenizer, conv, add_generation_prompt, chat_template_kwargs)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = _progress_bar(len(request_ids), use_tqdm)
        try:
            while len(finals) < len(request_ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finals[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self._abort_and_drain([r for r in request_ids if r not in finals])
            raise
        finally:
            if bar is not None:
                bar.close()
        errors = [out.error for out in finals.values() if out.error is not None]
        if errors:
            raise errors[0]
        return [finals[r] for r in request_ids]

    def _abort_and_drain(self, request_ids: list[str]) -> None:
        """Aborts the given requests and runs the step that applies the abort (blocks come back)."""
        if not request_ids or self.engine.closed:
            return
        self.engine.abort_request(request_ids)
        self.engine._apply_aborts()

    # ---- engine state ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Pool and scheduler counters: blocks used/free/cached, running/waiting, preemptions, hits."""
        return self.engine.stats()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _broadcast(name: str, value, n: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but there are {n} prompts; give one, or one per prompt")
        return list(value)
    return [value] * n


def _chat_token_ids(tokenizer, conversation, add_generation_prompt, kwargs) -> list[int]:
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **(kwargs or {}))
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
