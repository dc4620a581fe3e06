"""Which drafts a step accepted: the longest run of drafts equal to what the sampler drew at their rows.

Every verify row is sampled exactly as a plain decode step samples (greedy argmax, or temperature,
top-k, top-p, min-p with one uniform per row, seeded rows from their own generator). Row j's token s_j
is the token for position p + j + 1; draft d_{j+1} is accepted while s_j == d_{j+1}, and the request
gets s_0..s_a, a the number accepted: the drafts it kept, then the sampler's own token where the first
draft failed (or the bonus token after the last one). For greedy rows that is "accept while draft ==
argmax". For random rows it is rejection sampling of a one-hot draft distribution, realised by
coupling: the draft is accepted with probability p(d) (the sampler drew d), and on rejection the token
is the sampler's draw given that it is not d, i.e. from p with d removed and renormalised; the bonus
token is a draw from p at the last row. So every position's token has exactly the plain sampler's
distribution. A seeded request's generator is wound back to just after the draws of the positions it
kept, so it draws the same uniform for each position as without drafts: its output is the same token
for token whether or not (and however many) drafts were verified.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from pagednb.engine.sampler import SamplerOutput
    from pagednb.engine.scheduler import ScheduledRequest, SchedulerOutput

_NO_DRAFT = -2  # never a sampled token (those are >= 0, or -1 for a flagged row)


class DraftVerifier:
    def __init__(self) -> None:
        self.num_drafts = 0  # verifications: requests that fed drafts to a step
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._saved: list[tuple[int, torch.Generator, torch.Tensor]] = []

    def before_sampling(self, sched: SchedulerOutput) -> None:
        """Remembers the generator state of each seeded, randomly sampled request with drafts."""
        entries = [s for s in sched.scheduled if s.samples]
        self._saved = [(i, s.request.generator, s.request.generator.get_state()) for i, s in enumerate(entries)
                       if s.draft_token_ids and s.request.generator is not None
                       and not s.request.sampling_params.is_greedy]

    def accept(self, sched: SchedulerOutput, row_token_ids: list[int], sampler_output: SamplerOutput | None
               ) -> tuple[list[int], list[int], SamplerOutput | None]:
        """The sampled token of every row of a step with drafts -> per sampling request, in schedule order,
        its last token and how many of its drafts it accepted (the tokens it gets are its accepted drafts
        then that token); the sampler output cut to one row per request (its logprobs, if any, are of
        requests without drafts)."""
        entries = [s for s in sched.scheduled if s.samples]
        num_drafts = np.array([len(s.draft_token_ids) for s in entries], dtype=np.int64)
        first_row = np.cumsum(num_drafts + 1) - (num_drafts + 1)
        tokens = np.array(row_token_ids, dtype=np.int64)
        mismatches = np.flatnonzero(tokens != _next_drafts(entries, num_drafts, first_row, len(tokens)))
        stop_row = mismatches[np.searchsorted(mismatches, first_row)]  # every last row mismatches
        accepted = stop_row - first_row
        self.num_drafts += int(np.count_nonzero(num_drafts))
        self.num_draft_tokens += int(num_drafts.sum())
        self.num_accepted_tokens += int(accepted.sum())
        self._rewind_generators(accepted, num_drafts)
        return tokens[stop_row].tolist(), accepted.tolist(), _rows(sampler_output, first_row + num_drafts)

    def _rewind_generators(self, accepted: np.ndarray, num_drafts: np.ndarray) -> None:
        """Leaves each seeded generator as if it had drawn for the positions kept only (one uniform each,
        drawn as the sampler draws them)."""
        for i, generator, state in self._saved:
            if accepted[i] < num_drafts[i]:
                generator.set_state(state)
                for _ in range(int(accepted[i]) + 1):
                    torch.rand(1, generator=generator, device=generator.device)
        self._saved = []

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: 1 (the sampler's own) + the drafts accepted, on average (vLLM's)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def _next_drafts(entries: list[ScheduledRequest], num_drafts: np.ndarray, first_row: np.ndarray,
                 num_rows: int) -> np.ndarray:
    """[rows] the draft each row's sampled token is checked against (row j: draft j + 1), _NO_DRAFT at
    every request's last row."""
    expected = np.full(num_rows, _NO_DRAFT, dtype=np.int64)
    for i in np.flatnonzero(num_drafts).tolist():
        expected[first_row[i]:first_row[i] + num_drafts[i]] = entries[i].draft_token_ids
    return expected


def _rows(out: SamplerOutput | None, rows: np.ndarray) -> SamplerOutput | None:
    """The sampler output at one row per request (the last of each), for its logprobs."""
    if out is None or out.logprobs is None:
        return out
    index = torch.from_numpy(rows).to(out.logprobs.device)
    pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
    return replace(out, token_ids=pick(out.token_ids), logprobs=pick(out.logprobs),
                   top_logprobs=pick(out.top_logprobs), top_token_ids=pick(out.top_token_ids), ranks=pick(out.ranks))
