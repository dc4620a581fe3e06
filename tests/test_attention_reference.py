"""TorchReferenceBackend computes exactly what dense causal attention computes, through a paged cache."""
from __future__ import annotations

import pytest
import torch

from pagednb.attention import AttentionMetadata, TorchReferenceBackend

BLOCK_SIZE, NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 64, 4, 2, 8


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int,
                    scale: float, window: int | None) -> torch.Tensor:
    """The naive definition: the last len(q) tokens of a sequence attend to its first seq_len keys."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for j in range(q.shape[0]):
        p = seq_len - q.shape[0] + j
        lo = 0 if window is None else max(0, p - window + 1)
        scores = torch.einsum("hd,thd->ht", q[j], k[lo:p + 1]) * scale
        out[j] = torch.einsum("ht,thd->hd", scores.softmax(-1), v[lo:p + 1])
    return out


class PagedBatch:
    """Random sequences whose earlier tokens already sit in a paged cache, in shuffled blocks."""

    def __init__(self, seq_lens: list[int], query_lens: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens, self.query_lens = seq_lens, query_lens
        self.keys = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen) for n in seq_lens]
        self.values = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen) for n in seq_lens]
        self.queries = [torch.randn(q, NUM_HEADS, HEAD_DIM, generator=gen) for q in query_lens]
        width = max(-(-n // BLOCK_SIZE) for n in seq_lens) + 1
        perm = torch.randperm(NUM_BLOCKS, generator=gen)[: len(seq_lens) * width]
        self.block_tables = perm.view(len(seq_lens), width).int()
        self.cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        for i, n in enumerate(seq_lens):  # the context, written as if by earlier steps
            slots = self.slots(i, range(n - query_lens[i]))
            self.cache[0].view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = self.keys[i][: len(slots)]
            self.cache[1].view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = self.values[i][: len(slots)]

    def slots(self, seq: int, positions) -> torch.Tensor:
        positions = torch.tensor(list(positions), dtype=torch.long)
        blocks = self.block_tables[seq].long()[positions // BLOCK_SIZE]
        return blocks * BLOCK_SIZE + positions % BLOCK_SIZE

    def step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """This step's new query/key/value rows (varlen) and their metadata."""
        new = [range(n - q, n) for n, q in zip(self.seq_lens, self.query_lens)]
        key = torch.cat([k[r.start:] for k, r in zip(self.keys, new)])
        value = torch.cat([v[r.start:] for v, r in zip(self.values, new)])
        starts = [0]
        for q in self.query_lens:
            starts.append(starts[-1] + q)
        metadata = AttentionMetadata(
            slot_mapping=torch.cat([self.slots(i, r) for i, r in enumerate(new)]),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            block_tables=self.block_tables, max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens), query_start_loc_cpu=starts,
            seq_lens_cpu=list(self.seq_lens))
        return torch.cat(self.queries), key, value, metadata

    def expected(self, scale: float, window: int | None) -> torch.Tensor:
        return torch.cat([dense_attention(q, k, v, len(k), scale, window)
                          for q, k, v in zip(self.queries, self.keys, self.values)])


def run_step(batch: PagedBatch, window: int | None) -> torch.Tensor:
    backend = TorchReferenceBackend()
    query, key, value, metadata = batch.step()
    backend.write_kv(key, value, batch.cache, metadata.slot_mapping)
    return backend.attend(query, batch.cache, metadata, HEAD_DIM ** -0.5, window)


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_batch_of_decodes_and_chunks_matches_dense_attention(window):
    # decode rows, a prefill chunk over cached context, a first token, a whole prompt
    batch = PagedBatch(seq_lens=[7, 13, 1, 22, 9, 6], query_lens=[1, 5, 1, 1, 9, 6])
    torch.testing.assert_close(run_step(batch, window), batch.expected(HEAD_DIM ** -0.5, window))


@pytest.mark.parametrize("window", [None, 3])
def test_pure_decode_batch_matches_dense_attention(window):
    batch = PagedBatch(seq_lens=[5, 1, 17, 8, 4], query_lens=[1] * 5, seed=1)
    torch.testing.assert_close(run_step(batch, window), batch.expected(HEAD_DIM ** -0.5, window))


def test_new_keys_and_values_land_in_their_slots():
    batch = PagedBatch(seq_lens=[6, 3], query_lens=[2, 3], seed=2)
    _, key, value, metadata = batch.step()
    TorchReferenceBackend().write_kv(key, value, batch.cache, metadata.slot_mapping)
    flat_keys = batch.cache[0].view(-1, NUM_KV_HEADS, HEAD_DIM)
    flat_values = batch.cache[1].view(-1, NUM_KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat_keys[metadata.slot_mapping], key)
    torch.testing.assert_close(flat_values[metadata.slot_mapping], value)


def test_rows_with_slot_minus_one_are_not_written():
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    value = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    TorchReferenceBackend().write_kv(key, value, cache, torch.tensor([9, -1, 2]))
    flat = cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat[0, [9, 2]], key[[0, 2]])
    torch.testing.assert_close(flat[1, [9, 2]], value[[0, 2]])
    assert flat.ne(0).any(dim=(2, 3)).sum() == 4  # only those two slots, in K and in V


def test_output_keeps_the_query_dtype():
    batch = PagedBatch(seq_lens=[5, 9], query_lens=[1, 4], seed=3)
    query, key, value, metadata = batch.step()
    cache = batch.cache.to(torch.bfloat16)
    backend = TorchReferenceBackend()
    backend.write_kv(key, value, cache, metadata.slot_mapping)
    out = backend.attend(query.to(torch.bfloat16), cache, metadata, HEAD_DIM ** -0.5, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), batch.expected(HEAD_DIM ** -0.5, None),
                               atol=3e-2, rtol=3e-2)
