"""Logprobs as vLLM returns them: for a token, its logprob and rank, plus the top-k alternatives.

Raw logprobs, vLLM v1's default (`logprobs_mode="raw_logprobs"`): the log-softmax of the model's own
logits in float32, before penalties, min_tokens masking, temperature and top-k/top-p/min-p. A rank is
1 + the number of tokens more likely than it, counting ties as more likely (as vLLM counts them), so
the most likely token has rank 1. `k = -1` means the whole vocabulary (vLLM's rule).

Prompt logprobs (`prompt_logprobs=k`) come from the prefill itself: the LM head runs on every prompt
row of the requests that asked for them, in every chunk, and position p's entry is read from the row
of position p - 1 (the first prompt token has none: None, as in vLLM). Such requests skip prefix-cache
hits (as vLLM does), so their prompt is always computed; a preempted request recomputes its prompt and
the positions already recorded are kept, not repeated. Only steps holding such rows pay for this: the
scheduler says so (SchedulerOutput.wants_prompt_logprobs), a plain step never looks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagednb.engine.scheduler import SchedulerOutput
    from pagednb.request import Request


def num_logprobs(k: int, vocab_size: int) -> int:
    """How many alternatives `k` asks for: -1 is the whole vocabulary; never more than it."""
    return vocab_size if k < 0 else int(min(k, vocab_size))


@dataclass
class TokenLogprobs:
    """For n rows: each row's given token with its logprob and rank, and the row's top-k (descending)."""

    logprobs: torch.Tensor  # [n] float32
    ranks: torch.Tensor  # [n] int64, 1 = most likely
    top_logprobs: torch.Tensor | None  # [n, k_max]; None when k_max is 0
    top_token_ids: torch.Tensor | None  # [n, k_max]


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k_max: int) -> TokenLogprobs:
    """`logprobs` is [n, V] (a log-softmax); `token_ids` [n], negative ids (flagged rows) read token 0."""
    chosen = logprobs.gather(1, token_ids.clamp(min=0).unsqueeze(1))
    ranks = (logprobs >= chosen).sum(-1)
    if k_max == 0:
        return TokenLogprobs(chosen.squeeze(1), ranks, None, None)
    top = logprobs.topk(k_max, dim=-1)
    return TokenLogprobs(chosen.squeeze(1), ranks, top.values, top.indices)


@dataclass
class PromptSpan:
    """One request's prompt rows in a step: entries for prompt positions first_position.. (count of them),
    at rows row_start.. of the step's PromptLogprobs."""

    request: Request
    first_position: int
    row_start: int
    count: int


@dataclass
class PromptLogprobs:
    spans: list[PromptSpan]
    values: TokenLogprobs


def prompt_rows(sched: SchedulerOutput) -> tuple[list[int], list[int], list[PromptSpan]]:
    """(the step's hidden rows that predict a prompt token, those tokens, each request's span) for the
    requests that asked for prompt logprobs. A chunk's row at position p predicts prompt token p + 1;
    the last prompt row predicts the first output token, which the sampler handles."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[PromptSpan] = []
    offset = 0
    for s in sched.scheduled:
        req = s.request
        end = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)
        if req.sampling_params.prompt_logprobs is not None and s.start < end:
            spans.append(PromptSpan(req, s.start + 1, len(rows), end - s.start))
            rows += range(offset, offset + end - s.start)
            targets += req.prompt_token_ids[s.start + 1:end + 1]
        offset += s.num_new_tokens
    return rows, targets, spans


def compute_prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, sched: SchedulerOutput
                            ) -> PromptLogprobs | None:
    """The LM head on the step's prompt rows that asked for logprobs, as raw logprobs; None if none."""
    rows, targets, spans = prompt_rows(sched)
    if not rows:
        return None
    device = hidden.device
    logprobs = model.compute_logits(hidden[torch.tensor(rows, device=device)]).float().log_softmax(-1)
    vocab = logprobs.shape[-1]
    k_max = max(num_logprobs(s.request.sampling_params.prompt_logprobs, vocab) for s in spans)
    return PromptLogprobs(spans, token_logprobs(logprobs, torch.tensor(targets, device=device), k_max))
