"""A drafted request's verify tokens as one-token decode rows: verification on the decode kernels as they are.

A request at position p with drafts d_1..d_k feeds 1 + k tokens: its last token and the drafts. Rather
than a (k + 1)-token "prefill chunk", each token becomes a sequence of its own: row j at position p + j,
seq_len p + j + 1, the request's block-table row. Attention writes every token's K/V into its slot
before any query reads the cache, so row j sees exactly the tokens <= p + j: causal verification with
the decode kernels (and the reference's batched decode path), and a decode-only step with drafts is
still one CUDA graph replay (its bucket counting rows). Every row gives logits; rejected drafts' K/V
stay in their slots until later tokens overwrite them (the request's computed count rolls back).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pagednb.engine.scheduler import ScheduledRequest
    from pagednb.request import Request


def split_verify_rows(scheduled: list[ScheduledRequest], reqs: list[Request], starts: np.ndarray,
                      lens: np.ndarray, rows: np.ndarray, samples: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[Request]]:
    """Per scheduled request (starts, query lens, block-table rows, samples) -> the same per sequence,
    each drafted request split into 1 + k one-token sequences; also each sequence's request."""
    num_drafts = np.array([len(s.draft_token_ids) for s in scheduled], dtype=np.int64)
    per_request = num_drafts + 1
    owner = np.repeat(np.arange(len(scheduled)), per_request)
    offset = np.arange(len(owner)) - np.repeat(np.cumsum(per_request) - per_request, per_request)
    seq_lens = np.where(num_drafts[owner] > 0, 1, lens[owner])
    seq_reqs = [req for req, n in zip(reqs, per_request.tolist()) for _ in range(n)]
    return starts[owner] + offset, seq_lens, rows[owner], samples[owner], seq_reqs
