"""Prefix-prefill attention in PyTorch: the seed's tile loop and its pre-gathered rewrite.

New token j of a sequence attends to the sequence's whole cached context and to its new tokens 0..j.
Both variants walk tiles of ``block_m`` new tokens per sequence and compute each tile with a few
batched matmuls in float32; they differ only in where the context K/V are gathered from the cache.
"""
from __future__ import annotations

import torch

from kernels.paged import check_cache, gather_native, safe_tables


def _check(query, key, value, key_cache, value_cache, block_tables, query_start_loc, context_lens):
    if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape or key.shape[0] != query.shape[0]:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}: "
                         "expected [num_tokens, heads, head_size] with the same num_tokens")
    if query.shape[1] % key.shape[1] or query.shape[2] != key.shape[2]:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} disagree on heads or head size")
    bs = check_cache(key_cache, value_cache, key.shape[1], key.shape[2])
    num_seqs = context_lens.shape[0]
    if tuple(query_start_loc.shape) != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} / block_tables {tuple(block_tables.shape)} "
                         f"do not match {num_seqs} sequences")
    return bs


def _tile(q, k, v, ctx, first):
    """Attention of new tokens ``first..first+m`` (q [kvh, G, m, d]) over k, v [kvh, ctx+first+m, d]."""
    m = q.shape[2]
    s = q @ k.transpose(-1, -2)[:, None]  # [kvh, G, m, n]
    row = torch.arange(m, device=q.device)[:, None]
    col = torch.arange(k.shape[1], device=q.device)[None, :]
    s = s.masked_fill(col > ctx + first + row, float("-inf"))
    return torch.softmax(s, dim=-1) @ v[:, None]


def _prefill(query, key, value, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
             block_m, pregather):
    bs = _check(query, key, value, key_cache, value_cache, block_tables, query_start_loc, context_lens)
    num_tokens, num_heads, d = query.shape
    kvh = key.shape[1]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    ctxs = context_lens.tolist()
    tables = safe_tables(block_tables, context_lens, bs, block_tables.shape[1])
    for s, c in enumerate(ctxs):
        a, b = starts[s], starts[s + 1]
        nblk = -(-c // bs)
        q = (query[a:b].float() * scale).view(b - a, kvh, num_heads // kvh, d).permute(1, 2, 0, 3)
        new_k = key[a:b].float().transpose(0, 1)
        new_v = value[a:b].float().transpose(0, 1)
        if pregather:  # one gather of the context; every tile reads a view of it
            ck, cv = gather_native(key_cache, value_cache, tables[s:s + 1, :nblk])
            k_all = torch.cat([ck[0, :, :c].float(), new_k], 1)
            v_all = torch.cat([cv[0, :, :c].float(), new_v], 1)
        for t in range(0, b - a, block_m):
            e = min(t + block_m, b - a)
            if pregather:
                k, v = k_all[:, :c + e], v_all[:, :c + e]
            else:  # the seed's baseline: each tile gathers and lays out the context blocks again
                ck, cv = gather_native(key_cache, value_cache, tables[s:s + 1, :nblk])
                k = torch.cat([ck[0, :, :c].float().contiguous(), new_k[:, :e]], 1)
                v = torch.cat([cv[0, :, :c].float().contiguous(), new_v[:, :e]], 1)
            o = _tile(q[:, :, t:e], k, v, c, t)  # [kvh, G, m, d]
            out[a + t:a + e] = o.permute(2, 0, 1, 3).reshape(e - t, num_heads, d).to(query.dtype)
    return out


def prefix_prefill_loop(query, key, value, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                        scale, block_m=64, block_n=None, num_warps=None):
    """The seed's baseline; ``block_m`` is the tile size, ``block_n`` and ``num_warps`` do not apply."""
    return _prefill(query, key, value, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
                    block_m or 64, pregather=False)


def prefix_prefill_pregather(query, key, value, key_cache, value_cache, block_tables, query_start_loc,
                             context_lens, scale, block_m=256, block_n=None, num_warps=None):
    """Context K/V gathered once per sequence; ``block_m`` is the tile size."""
    return _prefill(query, key, value, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
                    block_m or 256, pregather=True)
