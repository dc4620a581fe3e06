"""N-gram drafts (prompt lookup): guess a request's next tokens from its own earlier tokens.

The longest suffix of the tokens, n from prompt_lookup_max down to prompt_lookup_min, that occurred
earlier in prompt + output is looked up, and the k tokens that followed its occurrence are proposed.
Among occurrences of that length the most recent wins: text being copied or a loop being repeated
continues the way it went last. An occurrence close to the end (the tokens loop
with a period shorter than k) runs out of following tokens: the draft then keeps repeating that
period, as an overlapping copy would, so a short loop still gets k drafts.

The search is O(len(tokens)) vectorised: one comparison of every token with the last finds the
candidate occurrences, and each longer n only filters the survivors.
"""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lookup_min = prompt_lookup_min
        self.lookup_max = prompt_lookup_max
        self._steps = np.arange(num_speculative_tokens)

    def propose(self, tokens: np.ndarray, max_drafts: int | None = None) -> list[int]:
        """Up to min(k, max_drafts) draft tokens following tokens ([n] ints); [] when nothing matches."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        n = len(tokens)
        if k <= 0 or n <= self.lookup_min:
            return []
        end = self._latest_match_end(tokens)
        if end < 0:
            return []
        period = n - 1 - end  # the match ends this many tokens before the last one
        return tokens[n - period + self._steps[:k] % period].tolist()

    def _latest_match_end(self, tokens: np.ndarray) -> int:
        """Where the most recent earlier occurrence of the longest matching suffix ends; -1 if none."""
        n = len(tokens)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # occurrences of the 1-gram suffix, oldest first
        best, best_len = ends, 1
        for m in range(1, min(self.lookup_max, n - 1)):
            ends = ends[ends >= m]
            ends = ends[tokens[ends - m] == tokens[n - 1 - m]]
            if not len(ends):
                break
            best, best_len = ends, m + 1
        if best_len < self.lookup_min or not len(best):
            return -1
        return int(best[-1])
