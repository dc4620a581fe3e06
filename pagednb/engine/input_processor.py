"""Input processing: a prompt and its SamplingParams in, a checked Request out.

Everything a request needs before it can be queued happens here, apart from the step loop:
tokenizing, prompt checks (length, vocabulary), truncation, max_tokens, a unique id, its own seeded
generator. A bad input raises TypeError (wrong type) or ValueError (out of range), naming the field,
before anything is queued, so a batch can be checked whole.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from pagednb.engine.parallel_sampling import ParentRequest, child_params, child_request_id
from pagednb.request import Request
from pagednb.sampling_params import SamplingParams
from pagednb.validation import INT64_MAX, as_int

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
        self._request_ids = itertools.count()  # automatic request ids: "0", "1", "2", ... (skipping ids in use)
        self._arrival_indices = itertools.count()  # breaks arrival-time ties in the scheduler's order

    def make_request(self, request_id: str | None, prompt: PromptType, sampling_params: SamplingParams | None = None,
                     priority: int = 0) -> Request | ParentRequest:
        """A checked Request (a ParentRequest of n children when n > 1); a bad argument raises TypeError or
        ValueError naming it, and nothing changes."""
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str or None, got {request_id!r} ({type(request_id).__name__})")
        params = self._check_params(sampling_params)
        priority = as_int("priority", priority, "an int", -INT64_MAX - 1, INT64_MAX)
        text, token_ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        self._check_prompt(token_ids)
        max_tokens = self._resolve_max_tokens(len(token_ids), params)
        if request_id is None:
            request_id = self._automatic_request_id(params.n)
        elif self._is_family_id_in_use(request_id, params.n):
            raise ValueError(f"request_id {request_id!r} is already in use" + (
                "" if params.n == 1 else f" (with its completions' ids '0_{request_id}'..'{params.n - 1}_{request_id}')"))
        if params.n > 1:
            return self._make_parent(request_id, text, token_ids, params, max_tokens, priority)
        return self._make_one(request_id, text, token_ids, params, max_tokens, priority)

    def _make_one(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams,
                  max_tokens: int, priority: int) -> Request:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        return Request(request_id, token_ids, params, max_tokens, prompt=text, priority=priority,
                       arrival_index=next(self._arrival_indices), eos_token_ids=self.eos_token_ids,
                       generator=generator)

    def _make_parent(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams,
                     max_tokens: int, priority: int) -> ParentRequest:
        """n > 1: n child requests of one prompt (engine/parallel_sampling.py), queued side by side."""
        children = [self._make_one(child_request_id(request_id, i), text, token_ids, child_params(params, i),
                                   max_tokens, priority) for i in range(params.n)]
        return ParentRequest(request_id, children, params.output_kind)

    def _is_family_id_in_use(self, request_id: str, n: int) -> bool:
        """The id, or with n > 1 any of its children's ids, taken by a request in flight."""
        if self._is_request_id_in_use(request_id):
            return True
        return n > 1 and any(self._is_request_id_in_use(child_request_id(request_id, i)) for i in range(n))

    def _automatic_request_id(self, n: int = 1) -> str:
        """The next counter value that no request in flight uses: a user may have taken "7" already."""
        while True:
            request_id = str(next(self._request_ids))
            if not self._is_family_id_in_use(request_id, n):
                return request_id

    def _check_params(self, sampling_params: SamplingParams | None) -> SamplingParams:
        """The request's own checked copy: a field the caller set after construction is checked too, and
        later changes to the caller's object cannot reach the running request. Then the limits that
        need the model's vocabulary."""
        if sampling_params is None:
            return SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams or None, got "
                            f"{type(sampling_params).__name__}")
        params = sampling_params.clone()
        vocab = self.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"{name} must be -1 (the whole vocabulary) or <= the vocabulary size ({vocab}), "
                                 f"got {k}")
        for i, token_id in enumerate(params.stop_token_ids):
            if token_id >= vocab:
                raise ValueError(f"stop_token_ids[{i}] = {token_id} is outside the vocabulary [0, {vocab})")
        return params

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            return self._tokenize_dict(prompt)
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple, torch.Tensor, np.ndarray)):
            return None, _as_token_list("prompt", prompt)
        raise TypeError(f"prompt must be a str, a list of token ids, or a dict with 'prompt' or "
                        f"'prompt_token_ids', got {type(prompt).__name__}")

    def _tokenize_dict(self, prompt: dict) -> tuple[str | None, list[int]]:
        unknown = sorted(map(repr, prompt.keys() - _PROMPT_KEYS))
        if unknown:
            raise ValueError(f"a prompt dict takes the keys 'prompt' and 'prompt_token_ids', got {', '.join(unknown)}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"prompt['prompt'] must be a str, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple, torch.Tensor, np.ndarray)):
                raise TypeError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
            return text, _as_token_list("prompt_token_ids", ids)
        if text is None:
            raise ValueError("a prompt dict needs 'prompt' (a str) or 'prompt_token_ids' (a list of ints)")
        return text, list(self.tokenizer(text).input_ids)

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


_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})


def _as_token_list(field: str, token_ids) -> list[int]:
    """Plain Python ints (numpy and torch ints converted); bools, floats, strings and nested lists are
    refused. The type test is one C-level pass (set of types), as prompts of thousands of tokens arrive
    by the hundred; the range is checked against the vocabulary afterwards."""
    if isinstance(token_ids, (torch.Tensor, np.ndarray)):
        is_int = (token_ids.dtype.kind in "iu" if isinstance(token_ids, np.ndarray)
                  else not (token_ids.dtype.is_floating_point or token_ids.dtype.is_complex
                            or token_ids.dtype == torch.bool))
        if token_ids.ndim != 1 or not is_int:
            raise TypeError(f"{field} must be a flat list of ints, got a {token_ids.ndim}-d "
                            f"{type(token_ids).__name__} of {token_ids.dtype}")
        return token_ids.tolist()
    ids = list(token_ids)
    types = set(map(type, ids))
    if types <= {int}:
        return ids
    if all(issubclass(t, np.integer) or t is int for t in types):
        return [int(t) for t in ids]
    i, bad = next((i, t) for i, t in enumerate(ids) if type(t) is not int and not isinstance(t, np.integer))
    raise TypeError(f"{field} must be a list of ints, got {type(bad).__name__} {bad!r:.60} at index {i}")


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
