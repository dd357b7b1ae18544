"""Prefix-prefill attention in Triton, FlashAttention-style, in the manner of vLLM's prefix_prefill.py.

One program takes BLOCK_M new tokens of one sequence and one query head. It streams the cached
context out of the paged cache (vLLM's layouts, read in place) and then the sequence's own new
tokens up to the diagonal, keeping a running max and sum (online softmax, base 2). Tiles fully
below the diagonal skip the causal mask.
"""
from __future__ import annotations

import torch

from kernels import triton_env
from kernels.prefill_torch import _check

import triton  # noqa: E402  (after triton_env: see its docstring)
import triton.language as tl  # noqa: E402


@triton.jit
def _online(q, k, v, m_i, l_i, acc, mask, PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """One step of the online softmax over a K^T [HEAD, BLOCK_N] / V [BLOCK_N, HEAD] tile."""
    s = tl.dot(q, k, input_precision=PRECISION)
    if MASKED:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton_env.jit_per_step("sbt0")
def _prefill_kernel(Q, Kn, Vn, Kc, Vc, BT, QSL, CTX, OUT, scale,
                    sq0, sq1, skn0, skn1, svn0, svn1, skc0, skc1, skc2, svc0, svc1, svc2, svc3, sbt0,
                    so0, so1,
                    GROUP: tl.constexpr, HEAD: tl.constexpr, X: tl.constexpr, SKC3: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    seq, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kvh = head // GROUP
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    ctx = tl.load(CTX + seq)
    m0 = tile * BLOCK_M
    if m0 < q_len:
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        d = tl.arange(0, HEAD)
        q = tl.load(Q + (q_start + rows)[:, None].to(tl.int64) * sq0 + head * sq1 + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        q = (q * (scale * 1.4426950408889634)).to(Q.dtype.element_ty)  # log2(e): softmax in base 2
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
        k_col = (d // X) * skc2 + d % X
        j = tl.arange(0, BLOCK_N)
        for n0 in range(0, ctx, BLOCK_N):  # the cached context, through the block table
            col, slot, first = triton_env.paged_tile(n0, j, BLOCK_N, BLOCK_SIZE)
            valid = n0 + j < ctx
            blk_ok = first < ctx  # whole blocks: the slots past ``ctx`` are read, then masked out
            blk = tl.load(BT + seq * sbt0 + col, mask=blk_ok, other=0).to(tl.int64)
            # SKC3 (x) a constant: each run of x head dims is known 16-byte aligned, K^T loads in vectors
            k = tl.load(Kc + blk[None, :] * skc0 + kvh * skc1 + k_col[:, None] + slot[None, :] * SKC3,
                        mask=blk_ok[None, :], other=0.0)
            v = tl.load(Vc + blk[:, None] * svc0 + kvh * svc1 + d[None, :] * svc2 + slot[:, None] * svc3,
                        mask=blk_ok[:, None], other=0.0)
            v = tl.where(valid[:, None], v, 0.0)  # unwritten slots may hold NaN, and 0 * NaN is NaN
            m_i, l_i, acc = _online(q, k, v, m_i, l_i, acc, valid[None, :], PRECISION, True)
        kn = Kn + kvh * skn1 + q_start.to(tl.int64) * skn0
        vn = Vn + kvh * svn1 + q_start.to(tl.int64) * svn0
        for n0 in range(0, m0, BLOCK_N):  # new tokens wholly before this tile: no mask
            n = n0 + tl.arange(0, BLOCK_N)
            k = tl.load(kn + n[None, :] * skn0 + d[:, None])
            v = tl.load(vn + n[:, None] * svn0 + d[None, :])
            m_i, l_i, acc = _online(q, k, v, m_i, l_i, acc, None, PRECISION, False)
        for n0 in range(m0, tl.minimum(m0 + BLOCK_M, q_len), BLOCK_N):  # the diagonal
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < q_len
            k = tl.load(kn + n[None, :] * skn0 + d[:, None], mask=valid[None, :], other=0.0)
            v = tl.load(vn + n[:, None] * svn0 + d[None, :], mask=valid[:, None], other=0.0)
            causal = (rows[:, None] >= n[None, :]) & valid[None, :]
            m_i, l_i, acc = _online(q, k, v, m_i, l_i, acc, causal, PRECISION, True)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + (q_start + rows)[:, None].to(tl.int64) * so0 + head * so1 + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (d < HEAD)[None, :])


def prefill_shared(block_m: int, block_n: int, head: int, stages: int, elt: int) -> int:
    """Shared memory of one program (bytes, on the high side): the query tile, K^T and V tiles per
    pipeline stage, the probabilities as a dot operand."""
    return (block_m * head + max(1, stages) * 2 * block_n * head + block_m * block_n) * elt + 2048


def launch_configs(block_m: int, block_n: int, num_warps: int, num_stages: int, head: int, elt: int,
                   block_size: int, device: torch.device) -> list[dict]:
    """The tiles asked for, then fewer stages, shorter query tiles, narrower key tiles: those whose
    shared memory fits the device, best first."""
    out = []
    for bn in [block_n] + [b for b in (32, 16) if b < block_n]:
        if bn % block_size and block_size % bn:
            continue
        for bm in [block_m] + [b for b in (64, 32, 16) if b < block_m]:
            for st in [num_stages] + [s for s in (1,) if s < num_stages]:
                if bm % bn == 0 and prefill_shared(bm, bn, head, st, elt) <= triton_env.max_shared_mem(device):
                    out.append(dict(block_m=bm, block_n=bn, num_warps=num_warps, num_stages=st))
    return out or [dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)]


_LAUNCH = triton_env.FirstThatFits()


def prefix_prefill_triton(query, key, value, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                          scale, block_m=128, block_n=64, num_warps=8, num_stages=2, max_query_len=None):
    """``max_query_len`` (the most new tokens of any sequence) sizes the grid; by default read off the device.
    Tiles whose shared memory the device lacks are narrowed (:func:`launch_configs`)."""
    block_size = _check(query, key, value, key_cache, value_cache, block_tables, query_start_loc, context_lens)
    num_tokens, num_heads, head = query.shape
    if head & (head - 1) or head < 16:
        raise ValueError(f"head_size must be a power of two >= 16, got {head}")
    block_m, block_n, num_warps = block_m or 128, block_n or 64, num_warps or 8
    if block_m % block_n or block_n < 16:
        raise ValueError(f"block_m {block_m} must be a multiple of block_n {block_n}, and block_n >= 16")
    if block_n % block_size and block_size % block_n:
        raise ValueError(f"block_n {block_n} and the cache's block size {block_size} must divide one another")
    if key_cache.stride(4) != 1:
        raise ValueError("the key cache's last dimension must be contiguous (vLLM's layout)")
    out = torch.empty_like(query)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())

    def run(cfg):
        grid = (num_seqs, num_heads, triton.cdiv(max_query_len, cfg["block_m"]))
        _prefill_kernel[grid](
            query, key, value, key_cache, value_cache, block_tables, query_start_loc, context_lens, out, scale,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *key_cache.stride()[:3], *value_cache.stride(), block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=num_heads // key.shape[1], HEAD=head, X=key_cache.shape[4], SKC3=key_cache.stride(3),
            BLOCK_SIZE=block_size, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
            PRECISION=triton_env.dot_precision(query.dtype), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])

    configs = launch_configs(block_m, block_n, num_warps, num_stages, head, query.element_size(), block_size,
                             query.device)
    _LAUNCH.launch(configs, run, key=(query.device, query.dtype, head, block_size))
    return out
