"""Paged decode attention in PyTorch: the seed's V1, its partitioned V2, and V2 on a converted layout.

All three gather the sequences' blocks with one indexing op and work in float32 over every sequence
at once; they differ in how the softmax over the context is split, as vLLM's CUDA kernels do.
"""
from __future__ import annotations

import torch

from kernels.paged import check_cache, gather_block_major, gather_native, safe_tables, to_block_major

PARTITION_SIZE = 512


def _check(query, key_cache, value_cache, block_tables, seq_lens) -> int:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs, num_heads, head_size], got {tuple(query.shape)}")
    num_seqs, num_heads, d = query.shape
    kvh = key_cache.shape[1] if key_cache.dim() == 5 else -1
    bs = check_cache(key_cache, value_cache, kvh, d)
    if num_heads % kvh:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {kvh}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or tuple(seq_lens.shape) != (num_seqs,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"do not match {num_seqs} sequences")
    return bs


def _gathered(query, key_cache, value_cache, block_tables, seq_lens, partition=None, block_major=False):
    """Query [S, kvh, G, d] (float32) and the context K, V [S, kvh, L, d] (float32), L padded to ``partition``."""
    bs = _check(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs, num_heads, d = query.shape
    kvh = key_cache.shape[1]
    max_len = int(seq_lens.max()) if num_seqs else 0
    length = -(-max_len // (partition or bs)) * (partition or bs)
    nblocks = -(-length // bs)
    tables = safe_tables(block_tables, seq_lens, bs, min(nblocks, block_tables.shape[1]))
    if tables.shape[1] < nblocks:  # a partition may reach past the table: pad with block 0, masked below
        tables = torch.nn.functional.pad(tables, (0, nblocks - tables.shape[1]))
    if block_major:
        k_blocks, v_blocks = to_block_major(key_cache, value_cache)
        k, v = gather_block_major(k_blocks, v_blocks, tables)
    else:
        k, v = gather_native(key_cache, value_cache, tables)
    q = query.float().view(num_seqs, kvh, num_heads // kvh, d)
    blank = ~_valid(seq_lens, length)[:, None, :, None]  # slots past a context may hold NaN: 0 * NaN is NaN
    return q, k[:, :, :length].float(), v[:, :, :length].float().masked_fill(blank, 0.0)


def _valid(seq_lens, length):
    return torch.arange(length, device=seq_lens.device)[None, :] < seq_lens.long()[:, None]  # [S, L]


def paged_decode_v1(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """One softmax over each whole context."""
    q, k, v = _gathered(query, key_cache, value_cache, block_tables, seq_lens)
    s = (q * scale) @ k.transpose(-1, -2)  # [S, kvh, G, L]
    s = s.masked_fill(~_valid(seq_lens, s.shape[-1])[:, None, None, :], float("-inf"))
    out = torch.softmax(s, dim=-1) @ v
    return out.reshape(query.shape).to(query.dtype)


def _partitioned(query, q, k, v, seq_lens, scale):
    """vLLM's paged_attention_v2: per-partition max, exp-sum and normalised output, then a log-sum-exp reduction."""
    num_seqs, kvh, group, d = q.shape
    parts = k.shape[2] // PARTITION_SIZE
    k = k.view(num_seqs, kvh, parts, PARTITION_SIZE, d)
    v = v.view(num_seqs, kvh, parts, PARTITION_SIZE, d)
    s = (q[:, :, None] * scale) @ k.transpose(-1, -2)  # [S, kvh, P, G, 512]
    valid = _valid(seq_lens, parts * PARTITION_SIZE).view(num_seqs, 1, parts, 1, PARTITION_SIZE)
    s = s.masked_fill(~valid, float("-inf"))
    max_logits = s.amax(dim=-1)  # [S, kvh, P, G]; -inf for partitions past the context
    shift = torch.where(torch.isfinite(max_logits), max_logits, torch.zeros_like(max_logits))
    p = torch.exp(s - shift[..., None])
    exp_sums = p.sum(dim=-1)
    tmp_out = (p @ v) / exp_sums.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    global_max = max_logits.amax(dim=2, keepdim=True)
    rescaled = torch.exp(max_logits - global_max) * exp_sums  # 0 for empty partitions
    out = (rescaled[..., None] * tmp_out).sum(dim=2) / rescaled.sum(dim=2)[..., None]
    return out.reshape(query.shape).to(query.dtype)


def paged_decode_v2(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """Partitions of 512 tokens reduced with log-sum-exp, on vLLM's cache layout."""
    q, k, v = _gathered(query, key_cache, value_cache, block_tables, seq_lens, PARTITION_SIZE)
    return _partitioned(query, q, k, v, seq_lens, scale)


def paged_decode_v2_layout(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """The seed's V2 patch: convert both caches to [blocks, kv_heads, block_size, head_size] each call, then V2."""
    q, k, v = _gathered(query, key_cache, value_cache, block_tables, seq_lens, PARTITION_SIZE, block_major=True)
    return _partitioned(query, q, k, v, seq_lens, scale)
