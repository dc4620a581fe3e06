"""Which running requests get draft tokens this step, and the drafts themselves.

A request is drafted for only while it decodes (its prompt computed) and only when its sampling reads
nothing but its logits: requests with structured output, logprobs or prompt_logprobs, penalties or
min_tokens, logit_bias / allowed_token_ids / bad_words are left to plain decoding (they stay correct;
their per-token state would need rolling back with rejected drafts). Under load drafting stops: a batch
of more than MAX_DRAFT_BATCH running requests reads its weights for many rows already, so a verify row
costs nearly as much as a decoded token and rarely pays (vLLM v0's speculative_disable_by_batch_size
turned drafting off the same way).

A draft is not free: each is a verify row, and a row re-reads its request's whole KV cache (the decode
kernels serve verification, verify_rows.py). So a request whose drafts keep failing backs off: after m > 2
verifications in a row whose first draft was rejected, it skips the next 2^(m - 2) - 1 chances to draft (at
most MAX_BACKOFF_STEPS); one accepted first draft resets it. Text that repeats now and then keeps most of
its drafts; text that never repeats soon costs little.

Each request's tokens are kept here as a growing numpy array, appended as they arrive, so a proposal
reads the history without converting the Python list every step.
"""
from __future__ import annotations

import numpy as np

from pagednb.engine.spec_decode.config import SpeculativeConfig
from pagednb.engine.spec_decode.ngram_proposer import NgramProposer
from pagednb.request import Request

# Above this many running requests no drafts are proposed: the standard workload's batch of 256 is never
# slowed (one length check per step), and batch sizes where decoding leaves the GPU idle keep drafting.
MAX_DRAFT_BATCH = 32


def max_draft_rows(config, spec_config) -> int:
    """Verify rows a step may add beyond one per request (the model runner's step buffers make room)."""
    if spec_config is None:
        return 0
    return min(config.max_num_seqs, MAX_DRAFT_BATCH) * spec_config.num_speculative_tokens
MAX_BACKOFF_STEPS = 15


def can_draft(req: Request) -> bool:
    """Whether a request's sampling depends on its logits alone (see the module docstring)."""
    p = req.sampling_params
    return not (req.needs_output_history or req.logits_state is not None or p.logprobs is not None
                or p.prompt_logprobs is not None or p.structured_outputs is not None or bool(p.logit_bias)
                or p.allowed_token_ids is not None)


class _TokenHistory:
    """A request's tokens so far, and how its last drafts fared."""

    __slots__ = ("tokens", "length", "first_draft", "drafted_at", "misses", "wait")

    def __init__(self) -> None:
        self.tokens = np.empty(256, dtype=np.int64)
        self.length = 0
        self.first_draft = -1  # the first token of the last drafts, proposed for position drafted_at
        self.drafted_at = 0
        self.misses = 0  # verifications in a row whose first draft failed
        self.wait = 0  # chances to draft still to skip

    def backs_off(self) -> bool:
        """Whether this request skips drafting now: counts the last drafts' outcome (the token at their
        first position is known by now), then any wait still due."""
        if self.first_draft >= 0 and self.length > self.drafted_at:
            hit = self.tokens[self.drafted_at] == self.first_draft
            self.misses = 0 if hit else self.misses + 1
            self.wait = 0 if hit else min((1 << max(self.misses - 2, 0)) - 1, MAX_BACKOFF_STEPS)
            self.first_draft = -1
        if self.wait:
            self.wait -= 1
            return True
        return False

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """Appends the tokens added since the last call (a request's tokens only ever grow)."""
        n = len(token_ids)
        if n > len(self.tokens):
            grown = np.empty(max(n, 2 * len(self.tokens)), dtype=np.int64)
            grown[:self.length] = self.tokens[:self.length]
            self.tokens = grown
        if n > self.length:
            self.tokens[self.length:n] = token_ids[self.length:]
            self.length = n
        return self.tokens[:n]


class Drafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.max_model_len = max_model_len
        self._histories: dict[str, _TokenHistory | None] = {}  # None: the request is never drafted for

    def propose(self, running: list[Request]) -> None:
        """Sets `spec_token_ids` of the decoding requests that may be drafted for (none under load). The
        scheduler caps them by the budget, max_tokens and max_model_len and consumes them."""
        if len(running) > MAX_DRAFT_BATCH:
            return
        histories = self._histories
        for req in running:
            if req.num_computed_tokens != req.num_tokens - 1:
                continue  # prefilling (or, after a preemption, recomputing)
            history = histories.get(req.request_id, False)
            if history is False:
                history = histories[req.request_id] = _TokenHistory() if can_draft(req) else None
            if history is not None:
                req.spec_token_ids = self._drafts(req, history)

    def _drafts(self, req: Request, history: _TokenHistory) -> list[int]:
        tokens = history.sync(req.all_token_ids)
        if history.backs_off():
            return []
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        drafts = self.proposer.propose(tokens, room)
        if drafts:
            history.first_draft, history.drafted_at = drafts[0], len(tokens)
        return drafts

    def forget(self, request_ids: list[str]) -> None:
        """Drops the histories of requests that left the running set (a preempted one starts again)."""
        histories = self._histories
        for request_id in request_ids:
            histories.pop(request_id, None)
