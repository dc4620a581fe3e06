"""Block tables of the running requests, kept in one persistent array so a step only appends.

Rebuilding a [num_seqs, max_blocks] table from Python lists every step would cost more than the rest
of the step's CPU work; instead each running request owns a row and the scheduler's new block ids are
written into it as they arrive. A hybrid model (engine/kv_cache_groups.py) has one table per layer group,
all sharing the request's row: tables[g, row].
"""
from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, num_groups: int = 1) -> None:
        self.tables = np.zeros((num_groups, max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self.table = self.tables[0]  # the only table of a uniform model
        self.num_blocks = np.zeros((num_groups, max_num_seqs), dtype=np.int32)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.row_of: dict[str, int] = {}

    def release(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)

    def start(self, request_id: str, block_ids: list[int], group: int = 0) -> None:
        """Gives a (re)admitted request a fresh row holding its current blocks (group 0's; the other
        groups' follow through append)."""
        self.release(request_id)
        row = self._free_rows.pop()
        self.row_of[request_id] = row
        self.num_blocks[:, row] = 0
        self.append(request_id, block_ids, group)

    def append(self, request_id: str, block_ids: list[int], group: int = 0) -> None:
        if not block_ids:
            return
        row = self.row_of[request_id]
        n = int(self.num_blocks[group, row])
        self.tables[group, row, n:n + len(block_ids)] = block_ids
        self.num_blocks[group, row] = n + len(block_ids)

    def start_groups(self, request_id: str, block_ids: list[list[int]]) -> None:
        self.start(request_id, block_ids[0])
        for group in range(1, len(block_ids)):
            self.append(request_id, block_ids[group], group)

    def append_groups(self, request_id: str, block_ids: list[list[int]]) -> None:
        for group, ids in enumerate(block_ids):
            self.append(request_id, ids, group)
