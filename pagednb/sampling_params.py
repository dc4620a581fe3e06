"""Per-request sampling and output options, validated once when the request arrives."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

# Temperatures this small make softmax overflow-prone and are indistinguishable from argmax.
_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text/tokens so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # a single output when the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2  # random, drawn from the request's own generator


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "-1 (off) or >= 1")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "an int or None")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty,
               "in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty,
               "in [-2, 2]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
               ">= 1 or None")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"<= max_tokens ({self.max_tokens})")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "ints >= 0")
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", self.logprobs,
               ">= 0 or None")
        _check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
               "truncate_prompt_tokens", self.truncate_prompt_tokens, ">= 1 or None")
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind", self.output_kind,
               "a RequestOutputKind")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def clone(self) -> SamplingParams:
        """A copy whose lists can be changed without touching this one."""
        return dataclasses.replace(self, stop=list(self.stop),
                                   stop_token_ids=list(self.stop_token_ids))


def _check(ok: bool, field: str, value: object, limit: str) -> None:
    if not ok:
        raise ValueError(f"{field} must be {limit}, got {value!r}")
