"""Input processing: a prompt and its SamplingParams in, a checked Request out.

Everything a request needs before it can be queued happens here, apart from the step loop:
tokenizing, prompt checks (length, vocabulary), truncation, max_tokens, a unique id, its own seeded
generator. A bad input raises ValueError before anything is queued, so a batch can be checked whole.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from pagednb.request import Request
from pagednb.sampling_params import SamplingParams

PromptType = str | Sequence[int] | dict


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 device: torch.device, is_request_id_in_use: Callable[[str], bool]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.device = device  # where per-request seeded generators live (the sampler's device)
        self._is_request_id_in_use = is_request_id_in_use
        self._request_ids = itertools.count()  # automatic request ids: "0", "1", "2", ...
        self._arrival_indices = itertools.count()  # breaks arrival-time ties in the scheduler's order

    def make_request(self, request_id: str | None, prompt: PromptType, sampling_params: SamplingParams | None = None,
                     priority: int = 0) -> Request:
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
        request_id = str(next(self._request_ids)) if request_id is None else str(request_id)
        if self._is_request_id_in_use(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        return Request(request_id, token_ids, params, max_tokens, prompt=text, priority=priority,
                       arrival_index=next(self._arrival_indices), eos_token_ids=self.eos_token_ids,
                       generator=generator)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
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
        vocab = self.vocab_size
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


def find_eos_token_ids(tokenizer, hf_config, model_path) -> frozenset[int]:
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
