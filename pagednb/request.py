"""A request as the engine sees it: its tokens, its progress through the cache, and its state."""
from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

import torch

from pagednb.outputs import Logprob
from pagednb.sampling_params import SamplingParams


class SamplingError(RuntimeError):
    """One request's sampling had no valid distribution (NaN or infinite logits, or every token masked).
    That request alone ends with finish_reason "error"; the engine and every other request go on."""


class RequestStatus(enum.IntEnum):
    """Ordered so that every status after PREEMPTED is a finished one (as in vLLM v1)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# the parameters that shape a row's logits, named in a SamplingError
_NUMERIC_SAMPLING_FIELDS = frozenset({"temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                      "presence_penalty", "frequency_penalty", "min_tokens",
                                      "logit_bias", "allowed_token_ids", "bad_words", "structured_outputs"})

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One generation. Carries its own token history, KV blocks and sampling state.

    `num_computed_tokens` counts tokens whose K/V are in the cache; the tokens still to feed are
    all_token_ids[num_computed_tokens:]. A preempted request drops its blocks and resets that count:
    it is recomputed from scratch later (prefix caching usually makes that cheap).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    prompt: str | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_index: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens sampled on the device but not yet known here (0 or 1): with asynchronous scheduling the
    # next step is scheduled, and its input read from the device, before this step's tokens arrive.
    num_pending_tokens: int = 0
    # draft tokens for the next step (speculative decoding, engine/spec_decode/): proposed before scheduling,
    # used once by the scheduler; drafts that fail verification are simply not appended
    spec_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per output token (logprobs=k)
    cumulative_logprob: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    error: BaseException | None = None  # why it ended with FINISHED_ERROR on its own (SamplingError)
    # bad-word token ids and grammar matcher (engine/logits_processors.py); None when no processor is used
    logits_state: object | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        params = self.sampling_params
        # Sampling that reads the output so far (penalties, min_tokens) needs every token on the host
        # before the next step is built, so such a request turns asynchronous scheduling off. So do
        # bad_words (they read the output). Structured outputs do not: a step with a grammar row launches its
        # forward and defers its sampling until the matcher has the last token (engine/structured_output.py).
        self.needs_output_history = params.has_penalties or params.min_tokens > 0 or bool(params.bad_words)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def sampling_error(self) -> SamplingError:
        """The error of a request whose next token could not be sampled, naming its unusual parameters."""
        params = self.sampling_params
        defaults = type(params)()
        unusual = ", ".join(f"{f.name}={getattr(params, f.name)!r}" for f in dataclasses.fields(params)
                            if f.name in _NUMERIC_SAMPLING_FIELDS
                            and getattr(params, f.name) != getattr(defaults, f.name))
        return SamplingError(
            f"request {self.request_id!r}: no token could be sampled at output token {self.num_output_tokens + 1}: "
            f"its logits became NaN or infinite, or every token was masked (after penalties, temperature and "
            f"filters; {unusual or 'default sampling parameters'}). This request alone ended with finish_reason "
            f"'error'; the blocks it computed left the prefix cache.")

    def sort_key(self) -> tuple[int, float, int]:
        """Priority order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time, self.arrival_index)
