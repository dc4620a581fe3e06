"""Paged attention in plain PyTorch: the reference every faster backend is checked against.

Decode rows (one new token per sequence) dominate a serving step, so they are computed for all such
sequences in one batched op over a padded gather of their blocks. Prefill chunks are few and large,
so looping over them costs little Python time. Math runs in float32 whatever the cache dtype. An fp8
cache stores fp8(x / scale) and is read as fp8 * scale (attention/kv_quant.py): the oracle of the kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagednb.attention.backend import AttentionBackend, AttentionMetadata
from pagednb.attention.kv_quant import FP8_DTYPE, dequantize, is_fp8, quantize


class TorchReferenceBackend(AttentionBackend):
    """Correct on any device, fast enough on CPU; no custom kernels."""

    name = "torch_ref"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
        if is_fp8(kv_cache.dtype):  # scattered as bytes: torch's CUDA indexing kernels skip fp8 types
            key, value = quantize(key, k_scale).view(torch.uint8), quantize(value, v_scale).view(torch.uint8)
            kv_cache = kv_cache.view(torch.uint8)
        kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = key.to(kv_cache.dtype)
        kv_cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = value.to(kv_cache.dtype)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, sliding_window: int | None, softcap: float | None = None,
               k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        kv_scales = (k_scale, v_scale) if is_fp8(kv_cache.dtype) else None
        starts = metadata.query_start_loc_cpu
        query_lens = [starts[i + 1] - starts[i] for i in range(metadata.num_seqs)]
        output = torch.zeros_like(query)  # rows past the last sequence (padding) stay zero
        decode_seqs = [i for i, n in enumerate(query_lens) if n == 1]
        if decode_seqs:
            self._attend_decode(query, output, kv_cache, metadata, decode_seqs, scale, sliding_window, softcap,
                                kv_scales)
        for i, n in enumerate(query_lens):
            if n > 1:
                self._attend_chunk(query, output, kv_cache, metadata, i, scale, sliding_window, softcap, kv_scales)
        return output

    def _attend_decode(self, query: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor,
                       md: AttentionMetadata, seqs: list[int], scale: float,
                       window: int | None, softcap: float | None, kv_scales: tuple[float, float] | None) -> None:
        """All single-token rows at once: gather their blocks into one padded [B, T, Hkv, D]."""
        device = query.device
        if len(seqs) == md.num_seqs:  # the common pure-decode step: no index juggling
            rows = md.query_start_loc[:-1].long()
            seq_lens, tables = md.seq_lens.long(), md.block_tables
        else:
            idx = torch.tensor(seqs, device=device)
            rows = md.query_start_loc[idx].long()
            seq_lens, tables = md.seq_lens[idx].long(), md.block_tables[idx]
        max_len = max(md.seq_lens_cpu[i] for i in seqs)
        key, value = _gather_blocks(kv_cache, tables, max_len, kv_scales)
        positions = (seq_lens - 1)[:, None]  # [B, 1]: each row's own position
        allowed = _causal_window_mask(positions, key.shape[1], window)
        output[rows] = _masked_attention(query[rows][:, None], key, value, allowed, scale, softcap)[:, 0]

    def _attend_chunk(self, query: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor,
                      md: AttentionMetadata, seq: int, scale: float, window: int | None,
                      softcap: float | None, kv_scales: tuple[float, float] | None) -> None:
        """One prefill chunk: its queries attend over the cached context plus themselves."""
        start, end = md.query_start_loc_cpu[seq], md.query_start_loc_cpu[seq + 1]
        seq_len = md.seq_lens_cpu[seq]
        key, value = _gather_blocks(kv_cache, md.block_tables[seq:seq + 1], seq_len, kv_scales)
        positions = torch.arange(seq_len - (end - start), seq_len, device=query.device)[None]
        allowed = _causal_window_mask(positions, seq_len, window)
        output[start:end] = _masked_attention(query[None, start:end], key, value, allowed, scale, softcap)[0]


def _gather_blocks(kv_cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int,
                   kv_scales: tuple[float, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the first num_tokens tokens of each row's sequence: 2 x [B, T, Hkv, D];
    kv_scales (an fp8 cache): dequantised to float32 with those (k, v) scales."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-num_tokens // block_size)
    blocks = block_tables[:, :num_blocks].long()
    batch = blocks.shape[0]
    if kv_scales is not None:  # gathered as bytes: torch's CUDA indexing kernels skip fp8 types
        kv_cache = kv_cache.view(torch.uint8)
    key = kv_cache[0][blocks].reshape(batch, num_blocks * block_size, *kv_cache.shape[-2:])
    value = kv_cache[1][blocks].reshape(batch, num_blocks * block_size, *kv_cache.shape[-2:])
    key, value = key[:, :num_tokens], value[:, :num_tokens]
    if kv_scales is not None:
        key, value = dequantize(key.view(FP8_DTYPE), kv_scales[0]), dequantize(value.view(FP8_DTYPE), kv_scales[1])
    return key, value


def _causal_window_mask(positions: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """[B, Q] query positions -> [B, Q, T] bool: key t visible iff t <= p and p - t < window."""
    keys = torch.arange(num_keys, device=positions.device)
    distance = positions[..., None] - keys  # [B, Q, T]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    return allowed


def _masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      allowed: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
    """query [B, Q, H, D], key/value [B, T, Hkv, D], allowed [B, Q, T] -> [B, Q, H, D].

    GQA without repeating K/V: the `group` query heads that share a kv head are stacked along the
    query axis ([B, Hkv, group * Q, D]), so each kv head is read once. SDPA's fused CPU kernel does
    the math (in float32 here) several times faster than an einsum over the padded batch. SDPA has no
    soft-capping, so a softcap spells the softmax out (HF's eager order: scale, cap, mask, softmax).
    """
    batch, num_q, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    q = query.float().view(batch, num_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv_heads, group * num_q, head_dim)
    mask = allowed[:, None, None].expand(batch, 1, group, num_q, allowed.shape[-1])
    key, value = key.float().transpose(1, 2), value.float().transpose(1, 2)
    mask = mask.reshape(batch, 1, group * num_q, -1)
    if softcap:
        scores = softcap * torch.tanh(q @ key.transpose(-1, -2) * scale / softcap)
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ value
    else:
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    out = out.view(batch, num_kv_heads, group, num_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, num_q, num_heads, head_dim).to(query.dtype)
