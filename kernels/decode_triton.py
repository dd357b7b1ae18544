"""Paged decode attention V2 in Triton, reading vLLM's cache layouts in place.

One program takes one (sequence, kv head, split of the context) and computes all the query heads
that share that kv head together, so each K/V tile is read once and multiplied with ``tl.dot``.
The number of splits is fixed on the host from batch x kv heads against the SM count (so the grid
fills the GPU); each program derives its split's length from its sequence's length on the device,
so nothing is read back to the host and the launch can be captured in a CUDA graph. A second kernel
merges the splits with the log-sum-exp reduction of vLLM's paged_attention_v2.
"""
from __future__ import annotations

import torch

from kernels import triton_env
from kernels.decode_torch import _check
from kernels.prefill_triton import _online

import triton  # noqa: E402  (after triton_env: see its docstring)
import triton.language as tl  # noqa: E402


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Tokens per split of one sequence: its length spread over the grid's splits, in whole
    BLOCK_N tiles, at least MIN_SPLIT (short contexts use fewer splits; the rest exit at once)."""
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(per_split, MIN_SPLIT)


@triton.jit
def _tile(q, k_base, v_base, bt_row, n0, end, j, k_off, v_off, m_i, l_i, acc, sk0, sv0,
          SK3: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
          PRECISION: tl.constexpr):
    """One online-softmax step over the BLOCK_N tokens from ``n0``: K^T [HEAD, BLOCK_N] and
    V [BLOCK_N, HEAD] gathered through the block table. Unmasked, every token is in the context;
    MASKED (a context's last, partial tile) reads only its blocks and zeroes the slots past ``end``."""
    col, slot, first = triton_env.paged_tile(n0, j, BLOCK_N, BLOCK_SIZE)
    valid = n0 + j < end  # used only when MASKED
    if MASKED:
        blk_ok = first < end  # whole blocks: within them the slots past ``end`` are read, then dropped
        blk = tl.load(bt_row + col, mask=blk_ok, other=0).to(tl.int64)
        k = tl.load(k_base + blk[None, :] * sk0 + k_off[:, None] + slot[None, :] * SK3, mask=blk_ok[None, :],
                    other=0.0)
        v = tl.load(v_base + blk[:, None] * sv0 + v_off[None, :] + slot[:, None], mask=blk_ok[:, None], other=0.0)
        v = tl.where(valid[:, None], v, 0.0)  # unwritten slots may hold NaN, and 0 * NaN is NaN
    else:
        blk = tl.load(bt_row + col).to(tl.int64)
        k = tl.load(k_base + blk[None, :] * sk0 + k_off[:, None] + slot[None, :] * SK3)
        v = tl.load(v_base + blk[:, None] * sv0 + v_off[None, :] + slot[:, None])
    return _online(q, k, v, m_i, l_i, acc, valid[None, :], PRECISION, MASKED)


@triton_env.jit_per_step("sbt0", "sm0", "sm1")
def _split_kernel(Q, K, V, BT, LENS, OUT, TMP, MAXS, SUMS, scale,
                  sq0, sq1, sk0, sk1, sk2, sv0, sv1, sv2, sbt0, so0, so1,
                  st0, st1, st2, sm0, sm1,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD: tl.constexpr, X: tl.constexpr,
                  SK3: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr,
                  MIN_SPLIT: tl.constexpr, SINGLE: tl.constexpr, PRECISION: tl.constexpr):
    seq, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(LENS + seq)
    split_len = _split_len(seq_len, tl.num_programs(2), BLOCK_N, MIN_SPLIT)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    g = tl.arange(0, GROUP_PAD)
    head = kvh * GROUP + g
    d = tl.arange(0, HEAD)
    q = tl.load(Q + seq * sq0 + head[:, None] * sq1 + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    q = (q * (scale * 1.4426950408889634)).to(Q.dtype.element_ty)  # log2(e): softmax in base 2
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD], tl.float32)
    # SK3 (a token's stride inside a block of K, x elements) is a constant so that the compiler
    # knows each run of x head dims is 16 bytes aligned: K^T then loads in 16-byte vectors
    k_off = (d // X) * sk2 + d % X
    v_off = d * sv2
    k_base = K + kvh * sk1
    v_base = V + kvh * sv1
    j = tl.arange(0, BLOCK_N)
    bt_row = BT + seq * sbt0
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):  # whole tiles: no masks, loads pipelined
        m_i, l_i, acc = _tile(q, k_base, v_base, bt_row, n0, end, j, k_off, v_off, m_i, l_i, acc, sk0, sv0,
                              SK3, BLOCK_SIZE, BLOCK_N, False, PRECISION)
    # the context's last, partial tile, in TAIL_N pieces: masking V takes it through registers,
    # and small pieces keep that from raising the whole kernel's register count
    jt = tl.arange(0, TAIL_N)
    for n0 in range(full_end, end, TAIL_N):
        m_i, l_i, acc = _tile(q, k_base, v_base, bt_row, n0, end, jt, k_off, v_off, m_i, l_i, acc, sk0, sv0,
                              SK3, BLOCK_SIZE, TAIL_N, True, PRECISION)
    l_i = tl.where(l_i > 0, l_i, 1.0)  # empty split: nothing is stored, avoid 0/0
    keep = (g < GROUP) & (tl.zeros([GROUP_PAD], tl.int32) + start < seq_len)
    keep_2d = keep[:, None] & (d < HEAD)[None, :]
    if SINGLE:
        tl.store(OUT + seq * so0 + head[:, None] * so1 + d[None, :], (acc / l_i[:, None]).to(OUT.dtype.element_ty),
                 mask=keep_2d)
    else:
        tl.store(TMP + seq * st0 + head[:, None] * st1 + split * st2 + d[None, :],
                 (acc / l_i[:, None]).to(TMP.dtype.element_ty),
                 mask=keep_2d)
        tl.store(MAXS + seq * sm0 + head * sm1 + split, m_i, mask=keep)
        tl.store(SUMS + seq * sm0 + head * sm1 + split, l_i, mask=keep)


@triton_env.jit_per_step("sm0", "sm1", "num_splits")
def _reduce_kernel(LENS, OUT, TMP, MAXS, SUMS, so0, so1, st0, st1, st2, sm0, sm1,
                   num_splits, HEAD: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
                   CHUNK: tl.constexpr):
    """Log-sum-exp merge of one (sequence, head)'s splits, CHUNK splits at a time (a context long
    enough for hundreds of splits never holds them all in registers): the largest maximum first,
    then the splits' outputs weighted by their exp-sums relative to it."""
    seq, head = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(LENS + seq)
    used = tl.cdiv(seq_len, _split_len(seq_len, num_splits, BLOCK_N, MIN_SPLIT))
    c = tl.arange(0, CHUNK)
    d = tl.arange(0, HEAD)
    maxs = MAXS + seq * sm0 + head * sm1
    sums = SUMS + seq * sm0 + head * sm1
    top = tl.full([CHUNK], float("-inf"), tl.float32)
    for p0 in range(0, used, CHUNK):
        top = tl.maximum(top, tl.load(maxs + p0 + c, mask=p0 + c < used, other=float("-inf")))
    m = tl.max(top, 0)
    acc = tl.zeros([HEAD], tl.float32)
    total = tl.zeros([CHUNK], tl.float32)
    for p0 in range(0, used, CHUNK):
        live = p0 + c < used
        w = tl.where(live, tl.exp2(tl.load(maxs + p0 + c, mask=live, other=float("-inf")) - m)
                     * tl.load(sums + p0 + c, mask=live, other=0.0), 0.0)
        o = tl.load(TMP + seq * st0 + head * st1 + (p0 + c)[:, None] * st2 + d[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w[:, None] * o, 0)
        total += w
    tl.store(OUT + seq * so0 + head * so1 + d, (acc / tl.sum(total, 0)).to(OUT.dtype.element_ty))


def num_splits(num_seqs: int, num_kv_heads: int, bound: int, device: torch.device, min_split: int,
               programs_per_sm: int = 8) -> int:
    """Splits per (sequence, kv head): several programs per SM, so that the last wave of equal-length
    programs leaves little of the machine idle, no more than a context of ``bound`` tokens can fill
    at ``min_split`` tokens each."""
    want = programs_per_sm * triton_env.num_sms(device)
    return max(1, min(-(-want // max(1, num_seqs * num_kv_heads)), -(-bound // min_split)))


def split_shared(block_n: int, head: int, group_pad: int, stages: int, elt: int) -> int:
    """Shared memory of one split program (bytes, on the high side): K^T and V tiles of ``block_n``
    tokens per buffered stage, the query heads and the probabilities as dot operands."""
    return max(1, stages - 1) * 2 * block_n * head * elt + group_pad * (head + block_n) * elt + 2048


def launch_configs(head: int, group_pad: int, elt: int, block_size: int, device: torch.device, block_n: int,
                   num_warps: int, num_stages: int) -> list[dict]:
    """The configuration asked for, then fewer stages, then narrower tiles: those whose shared
    memory fits the device, best first."""
    out = []
    for bn in [block_n] + [b for b in (64, 32, 16) if b < block_n]:
        if bn % block_size and block_size % bn:
            continue
        for st in [num_stages] + [s for s in (3, 2) if s < num_stages]:
            if split_shared(bn, head, group_pad, st, elt) <= triton_env.max_shared_mem(device):
                out.append(dict(block_n=bn, num_warps=num_warps, num_stages=st))
    return out or [dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages)]


_LAUNCH = triton_env.FirstThatFits()


def paged_decode_v2_triton(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len=None,
                           block_n=64, num_warps=4, num_stages=2, min_split=256, programs_per_sm=8):
    """``max_seq_len`` (an upper bound of ``seq_lens``; by default the block table's width) caps the
    number of splits. Each split covers at least ``min_split`` tokens (rounded up to ``block_n``).
    Tiles whose shared memory the device lacks are narrowed (:func:`launch_configs`)."""
    block_size = _check(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs, num_heads, head = query.shape
    kvh = key_cache.shape[1]
    group = num_heads // kvh
    if head & (head - 1) or head < 16:
        raise ValueError(f"head_size must be a power of two >= 16, got {head}")
    if key_cache.stride(4) != 1 or value_cache.stride(3) != 1:
        raise ValueError("the caches' last dimension must be contiguous (vLLM's layout)")
    query = query.contiguous()
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    bound = max_seq_len or block_tables.shape[1] * block_size
    block_n = max(16, min(block_n, triton_env.pow2(bound)))
    if query.element_size() == 4:  # float32 dots run on the FMA units from registers: 8K-element tiles
        block_n = max(16, min(block_n, 8192 // head))
    if block_n % block_size and block_size % block_n:
        raise ValueError(f"block_n {block_n} and the cache's block size {block_size} must divide one another")
    group_pad = triton_env.pow2(group, 16)

    def run(cfg):
        bn = cfg["block_n"]
        min_tokens = -(-max(min_split, bn) // bn) * bn
        splits = num_splits(num_seqs, kvh, bound, query.device, min_tokens, programs_per_sm)
        single = splits == 1
        # each split's normalised output in the query's dtype, as vLLM's tmp_out: a convex combination
        # of V rows, so in V's range; the maxima and sums that weight them stay float32
        tmp = torch.empty(num_seqs, num_heads, splits, head, dtype=query.dtype, device=query.device)
        maxs = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=query.device)
        sums = torch.empty_like(maxs)
        _split_kernel[(num_seqs, kvh, splits)](
            query, key_cache, value_cache, block_tables, seq_lens, out, tmp, maxs, sums, scale,
            query.stride(0), query.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3],
            block_tables.stride(0), out.stride(0), out.stride(1), tmp.stride(0), tmp.stride(1), tmp.stride(2),
            maxs.stride(0), maxs.stride(1), GROUP=group, GROUP_PAD=group_pad, HEAD=head, X=key_cache.shape[4],
            SK3=key_cache.stride(3), BLOCK_SIZE=block_size, BLOCK_N=bn, TAIL_N=max(16, min(bn, block_size)),
            MIN_SPLIT=min_tokens, SINGLE=single, PRECISION=triton_env.dot_precision(query.dtype),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if not single:
            _reduce_kernel[(num_seqs, num_heads)](
                seq_lens, out, tmp, maxs, sums, out.stride(0), out.stride(1), tmp.stride(0), tmp.stride(1),
                tmp.stride(2), maxs.stride(0), maxs.stride(1), splits, HEAD=head, BLOCK_N=bn, MIN_SPLIT=min_tokens,
                CHUNK=min(32, triton_env.pow2(splits)), num_warps=4)

    configs = launch_configs(head, group_pad, query.element_size(), block_size, query.device, block_n, num_warps,
                             num_stages)
    _LAUNCH.launch(configs, run, key=(query.device, query.dtype, head, group, block_size))
    return out
