"""What the engine hands back: one RequestOutput per request per step (or only at the end)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class Logprob:
    """vLLM's: a token's raw logprob, its rank in the vocabulary (1 = most likely) and its text (the
    tokenizer's decode([token_id]); None when the request has detokenize=False)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: {token_id: Logprob} holding the chosen token and the top-k alternatives (engine/logprobs.py).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    delta: str = ""  # the text added since the previous output of this request

    def finished(self) -> bool:
        """A method, as vLLM's (RequestOutput.finished stays an attribute, as vLLM's)."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # with prompt_logprobs: None for the first prompt token, then one dict per prompt position (as vLLM)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    error: BaseException | None = field(default=None, repr=False)
