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
- logprobs, prompt_logprobs: None or an int >= -1 (-1: the whole vocabulary, as in vLLM; at most the
  vocabulary size, checked when the request is added). Raw logprobs, vLLM v1's default (engine/logprobs.py)
- truncate_prompt_tokens: None or >= 1; output_kind: a RequestOutputKind; the rest are bools.
- detokenize=False: outputs carry token ids and text "" (as vLLM); stop strings are refused with it.
- logit_bias: None or {token id >= 0: finite float}, added as given (vLLM's rule; OpenAI's server
  clamps to [-100, 100], vLLM's SamplingParams does not); allowed_token_ids: None or a non-empty list
  of ids >= 0; bad_words: None or a list of str; structured_outputs: None or a StructuredOutputsParams.
- n: an int in [1, 4096], the number of completions of the prompt (engine/parallel_sampling.py);
  completion i samples with seed + i when seeded (vLLM's rule), so seed + n - 1 must fit too.
  best_of is refused: vLLM v1 has none (rank n completions by cumulative_logprob instead).
Checks that need the model (vocabulary size, max_model_len) happen when the request is added
(engine/input_processor.py).
"""
from __future__ import annotations

import dataclasses
import enum
import json as _json
from dataclasses import dataclass

from pagednb.validation import FLOAT32_MAX, INT64_MAX, as_bool, as_float, as_int

# Temperatures this small make softmax overflow-prone and are indistinguishable from argmax.
_GREEDY_EPS = 1e-5
TOP_P_FLOOR = 1e-8
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
SEED_MAX = 2**64 - 1
N_MAX = 4096  # completions per prompt: each is a request of its own in the scheduler
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
    n: int = 1
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
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # where the tokenizer's decode takes it (slow ones)
    detokenize: bool = True  # False: token ids only, text "" (vLLM's); stop strings need text
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    best_of: int | None = None  # vLLM v0's; refused (v1 has none): set only to say so clearly
    # token id -> added to its logit (as vLLM: applied as given, no clamping); before penalties
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never produced (their token sequences, as vLLM bans them)
    structured_outputs: StructuredOutputsParams | None = None  # a grammar every output follows

    def __post_init__(self) -> None:
        self._check_floats()
        self._check_ints()
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            as_bool(name, getattr(self, name))
        if not self.detokenize and self.stop:
            raise ValueError(f"stop strings need detokenize=True (they are found in the text), got stop={self.stop!r} "
                             f"with detokenize=False; use stop_token_ids instead, as in vLLM")
        self._check_logits_processors()
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
        self.n = as_int("n", self.n, f"an int in [1, {N_MAX}]", 1, N_MAX)
        if self.best_of is not None:
            raise ValueError(f"pagednb does not support best_of (got {self.best_of!r}), as vLLM v1: use n and "
                             f"rank the completions by cumulative_logprob (with logprobs=0)")
        top_k = as_int("top_k", self.top_k, "-1 or 0 (off) or an int >= 1", -1)
        self.top_k = -1 if top_k == 0 else top_k
        if self.seed is not None:
            self.seed = as_int("seed", self.seed, f"None or an int in [0, {SEED_MAX}]", 0, SEED_MAX)
            if self.seed + self.n - 1 > SEED_MAX:  # completion i samples with seed + i
                raise ValueError(f"seed must be <= {SEED_MAX} - (n - 1) = {SEED_MAX - self.n + 1} with n={self.n} "
                                 f"(completion i uses seed + i), got {self.seed}")
        if self.max_tokens is not None:
            self.max_tokens = as_int("max_tokens", self.max_tokens, "None or an int >= 1", 1)
        self.min_tokens = as_int("min_tokens", self.min_tokens, "an int >= 0", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, as_int(name, getattr(self, name),
                                           "None or an int >= -1 (-1: the whole vocabulary)", -1))
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = as_int("truncate_prompt_tokens", self.truncate_prompt_tokens,
                                                 "None or an int >= 1", 1)

    def _check_logits_processors(self) -> None:
        """Types and ranges that need no model; token ids are checked against the vocabulary at add time."""
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be None or a non-empty list of ints >= 0, got []")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
                raise TypeError(f"bad_words must be None or a list of str, got {self.bad_words!r:.80}")
            self.bad_words = list(self.bad_words)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be None or a StructuredOutputsParams, got "
                            f"{type(self.structured_outputs).__name__}")

    @property
    def uses_logits_processors(self) -> bool:
        """Whether the sampler masks or biases this request's logits (logit_bias, allowed_token_ids,
        bad_words, structured_outputs)."""
        return (self.logit_bias is not None or self.allowed_token_ids is not None
                or bool(self.bad_words) or self.structured_outputs is not None)

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


def _logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise TypeError(f"logit_bias must be None or a dict of token id -> float, got {type(bias).__name__}")
    return {as_int("logit_bias key", t, "a token id (an int >= 0)", 0, INT64_MAX):
            as_float(f"logit_bias[{t}]", b, f"a finite number in [-{FLOAT32_MAX:.3g}, {FLOAT32_MAX:.3g}]",
                     -FLOAT32_MAX, FLOAT32_MAX)
            for t, b in bias.items()}


def _token_ids(field: str, ids: object) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"{field} must be None or a list of ints >= 0, got {ids!r:.80} ({type(ids).__name__})")
    return [as_int(f"{field}[{i}]", t, "an int >= 0", 0, INT64_MAX) for i, t in enumerate(ids)]


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """The grammar a request's output must follow (vLLM's StructuredOutputsParams); set exactly one of:
    json (a JSON schema as a dict or str, or True for any JSON), regex, choice (a list of strings),
    grammar (EBNF, xgrammar's dialect), json_object=True (any JSON). disable_any_whitespace: JSON
    without free whitespace between its tokens (vLLM's option, off by default as in vLLM; where it is
    allowed pagednb bounds each run of it, see engine/structured_output.py)."""

    json: dict | str | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_fields = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_KINDS)}; "
                             f"got {', '.join(set_fields) or 'none'}")
        as_bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        if self.json is not None and not isinstance(self.json, (dict, str, bool)):
            raise TypeError(f"structured_outputs.json must be a JSON schema (dict or str) or True, "
                            f"got {type(self.json).__name__}")
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json)  # a snapshot (key order kept: it is the output's order)
        for field in ("regex", "grammar"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"structured_outputs.{field} must be a str, got {type(value).__name__}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty str, "
                                 f"got {self.choice!r:.80}")
            self.choice = list(self.choice)
        if self.json_object is not None:
            as_bool("structured_outputs.json_object", self.json_object)

    @property
    def kind(self) -> str:
        """The one field that is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple:
        value = getattr(self, self.kind)
        return (self.kind, tuple(value) if isinstance(value, list) else value, self.disable_any_whitespace)
