"""Per-request sampling and output options, checked once when built (and again, on a copy, when the
request is added): every field is type- and range-checked, with vLLM's conventions.

What each field accepts (a wrong type raises TypeError, a value out of range ValueError; both name the
field and this range). Ints also come as integral floats (top_k=40.0 -> 40; 2.5 is refused), never as
bools; floats must be finite (no NaN or inf) and within float32, the sampler's precision.
- temperature >= 0 (below 1e-5: greedy); top_p in (0, 1]; min_p in [0, 1]
- top_p below 1e-8 is raised to 1e-8. That keeps exactly the same tokens (only the most likely one,
  whose probability is at least 1/vocab_size > 1e-8 for any vocabulary under 10^8), but cannot underflow
  to 0 in float32, where "keep tokens until their mass reaches top_p" would keep none and give NaN.
- top_k: -1 or 0 mean off (stored as -1), else >= 1 (more than the vocabulary is the same as off)
- repetition_penalty in [1e-6, 1e6]: logits are divided or multiplied by it, and further out a
  float32 logit overflows to inf (1e-40 gives NaN) or a 0 logit times inf gives NaN
- presence_penalty, frequency_penalty in [-2, 2]
- seed: None or an int in [0, 2**64 - 1] (every seed torch.Generator takes; negatives are refused)
- max_tokens: None (as many as max_model_len allows) or >= 1; min_tokens in [0, max_tokens]
- stop: None, a non-empty str or a list of them; stop_token_ids: None or a list of ints >= 0
- logprobs: None or an int >= 0 (at most the vocabulary size, checked when the request is added)
- truncate_prompt_tokens: None or >= 1; output_kind: a RequestOutputKind; the rest are bools.
Checks that need the model (vocabulary size, max_model_len) happen when the request is added
(engine/input_processor.py).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from pagednb.validation import FLOAT32_MAX, INT64_MAX, as_bool, as_float, as_int

# Temperatures this small make softmax overflow-prone and are indistinguishable from argmax.
_GREEDY_EPS = 1e-5
TOP_P_FLOOR = 1e-8
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
SEED_MAX = 2**64 - 1
_TEMPERATURE_RANGE = f"a finite number in [0, {FLOAT32_MAX:.3g}]"


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
        self._check_floats()
        self._check_ints()
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            as_bool(name, getattr(self, name))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind "
                            f"({', '.join(k.name for k in RequestOutputKind)}), got {self.output_kind!r}")

    def _check_floats(self) -> None:
        self.temperature = as_float("temperature", self.temperature, _TEMPERATURE_RANGE, 0.0, FLOAT32_MAX)
        self.top_p = max(as_float("top_p", self.top_p, "in (0, 1]", 0.0, 1.0, low_open=True), TOP_P_FLOOR)
        self.min_p = as_float("min_p", self.min_p, "in [0, 1]", 0.0, 1.0)
        low, high = REPETITION_PENALTY_RANGE
        self.repetition_penalty = as_float("repetition_penalty", self.repetition_penalty,
                                           f"in [{low:g}, {high:g}] (1 = off)", low, high)
        self.presence_penalty = as_float("presence_penalty", self.presence_penalty, "in [-2, 2]", -2.0, 2.0)
        self.frequency_penalty = as_float("frequency_penalty", self.frequency_penalty, "in [-2, 2]", -2.0, 2.0)

    def _check_ints(self) -> None:
        top_k = as_int("top_k", self.top_k, "-1 or 0 (off) or an int >= 1", -1)
        self.top_k = -1 if top_k == 0 else top_k
        if self.seed is not None:
            self.seed = as_int("seed", self.seed, f"None or an int in [0, {SEED_MAX}]", 0, SEED_MAX)
        if self.max_tokens is not None:
            self.max_tokens = as_int("max_tokens", self.max_tokens, "None or an int >= 1", 1)
        self.min_tokens = as_int("min_tokens", self.min_tokens, "an int >= 0", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            self.logprobs = as_int("logprobs", self.logprobs, "None or an int >= 0", 0)
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = as_int("truncate_prompt_tokens", self.truncate_prompt_tokens,
                                                 "None or an int >= 1", 1)

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
        """A checked copy whose lists can be changed without touching this one (a field set after
        construction is checked here too)."""
        return dataclasses.replace(self, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids))


def _stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, (list, tuple)):
        raise TypeError(f"stop must be None, a str or a list of str, got {stop!r} ({type(stop).__name__})")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            error = TypeError if not isinstance(s, str) else ValueError
            raise error(f"stop must be non-empty strings, got {list(stop)!r} (stop[{i}] = {s!r})")
    return list(stop)


def _stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"stop_token_ids must be None or a list of ints >= 0, got {ids!r} ({type(ids).__name__})")
    return [as_int(f"stop_token_ids[{i}]", t, "an int >= 0", 0, INT64_MAX) for i, t in enumerate(ids)]
