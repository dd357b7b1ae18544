"""The gated delta rule in Triton: a chunked prefill and a recurrent decode kernel.

Both read and write every sequence's state in place in a buffer indexed by a slot tensor on the
device (the engine's state pool, or a fresh copy of ``initial_state``), read packed sequences'
bounds from ``cu_seqlens`` on the device, and never wait for the host: a decode step can be captured
in a CUDA graph. The state's value columns evolve independently (k, g and beta act on the key side
only), so programs split V into blocks of ``block_v`` columns and each holds a ``[K, block_v]``
float32 slice of one head's state in registers.

``triton_chunk`` (prefill) runs two kernels. The first, parallel over all chunks of ``chunk_size``
tokens, solves each chunk's triangular system by forward substitution and writes the chunk's
W_k, W_v and cumulative decay (see ``gdn_torch._chunk`` for the algebra). The second walks each
sequence's chunks in order, one program per (value block, sequence, head): U = W_v - W_k S, the
outputs exp(c) Q S + (Q K^T * D) U, then the state. ``triton_recurrent`` (decode) walks tokens one
at a time and touches each state once per step: its floor is the state bytes read and written.
"""
from __future__ import annotations

import torch

from kernels import gdn, triton_env

import triton  # noqa: E402  (after triton_env: see its docstring)
import triton.language as tl  # noqa: E402


@triton.jit
def _l2norm_rows(x, L2NORM: tl.constexpr):
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
    return x


@triton.jit
def _recurrent_kernel(Q, K, V, G, BETA, O, STATE, SLOTS, CU, scale, sq, sk, sv, sg, so,
                      H: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BV: tl.constexpr, L2NORM: tl.constexpr):
    vb, n, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(CU + n), tl.load(CU + n + 1)
    slot = tl.load(SLOTS + n).to(tl.int64)
    kh = h // GROUP
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    state = STATE + slot * (H * DK * DV) + h * (DK * DV) + dk[:, None] * DV + dv[None, :]
    s = tl.load(state).to(tl.float32)
    for t64 in range(bos, eos):  # CU is int64: so are the offsets below
        q = tl.load(Q + t64 * sq + kh * DK + dk).to(tl.float32)
        k = tl.load(K + t64 * sk + kh * DK + dk).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        v = tl.load(V + t64 * sv + h * DV + dv).to(tl.float32)
        g = tl.load(G + t64 * sg + h).to(tl.float32)
        beta = tl.load(BETA + t64 * sg + h).to(tl.float32)
        s = s * tl.exp(g)
        u = beta * (v - tl.sum(s * k[:, None], 0))
        s = s + k[:, None] * u[None, :]
        o = tl.sum(s * q[:, None], 0) * scale
        tl.store(O + t64 * so + h * DV + dv, o.to(O.dtype.element_ty))
    tl.store(state, s.to(STATE.dtype.element_ty))


@triton.jit
def _chunk_prepare_kernel(K, V, G, BETA, WK, WV, GC, CHUNK_SEQ, CHUNK_START, CU, num_seqs, sk, sv, sg,
                          H: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BT: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, PRECISION: tl.constexpr):
    c, h = tl.program_id(0), tl.program_id(1)
    n = tl.load(CHUNK_SEQ + c)
    if n < num_seqs:  # the grid is an upper bound of the chunk count
        start = tl.load(CHUNK_START + c).to(tl.int64)
        eos = tl.load(CU + n + 1)
        r = tl.arange(0, BT)
        rows = start + r
        valid = rows < eos
        dk = tl.arange(0, DK)
        k = tl.load(K + rows[:, None] * sk + (h // GROUP) * DK + dk[None, :], mask=valid[:, None], other=0.0)
        k = _l2norm_rows(k.to(tl.float32), L2NORM)
        g = tl.load(G + rows * sg + h, mask=valid, other=0.0).to(tl.float32)
        beta = tl.load(BETA + rows * sg + h, mask=valid, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, 0)  # padded rows have g = 0: their decay stays the last real row's
        strict = r[:, None] > r[None, :]
        kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
        lower = tl.where(strict, beta[:, None] * tl.exp(tl.where(strict, gc[:, None] - gc[None, :], 0.0)) * kk, 0.0)
        # (I + L)^-1 by forward substitution: row i becomes -L_i - sum_{s<i} L_is X_s
        inv = -lower
        for i in range(1, tl.minimum(eos - start, BT)):  # rows past the sequence's end stay 0
            row = tl.sum(tl.where(r[:, None] == i, inv, 0.0), 0)
            new = row + tl.sum(row[:, None] * inv, 0)
            inv = tl.where(r[:, None] == i, new[None, :], inv)
        inv = inv + tl.where(r[:, None] == r[None, :], 1.0, 0.0)
        wk = tl.dot(inv, k * (beta * tl.exp(gc))[:, None], input_precision=PRECISION)
        tl.store(WK + rows[:, None] * (H * DK) + h * DK + dk[None, :], wk, mask=valid[:, None])
        tl.store(GC + rows * H + h, gc, mask=valid)
        for v0 in tl.static_range(0, DV, BV):
            dv = v0 + tl.arange(0, BV)
            v = tl.load(V + rows[:, None] * sv + h * DV + dv[None, :], mask=valid[:, None], other=0.0)
            wv = tl.dot(inv, v.to(tl.float32) * beta[:, None], input_precision=PRECISION)
            tl.store(WV + rows[:, None] * (H * DV) + h * DV + dv[None, :], wv, mask=valid[:, None])


@triton.jit
def _chunk_scan_kernel(Q, K, WK, WV, GC, O, STATE, SLOTS, CU, scale, sq, sk, so,
                       H: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BT: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, PRECISION: tl.constexpr):
    vb, n, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(CU + n), tl.load(CU + n + 1)
    slot = tl.load(SLOTS + n).to(tl.int64)
    kh = h // GROUP
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    r = tl.arange(0, BT)
    incl = r[:, None] >= r[None, :]
    state = STATE + slot * (H * DK * DV) + h * (DK * DV) + dk[:, None] * DV + dv[None, :]
    s = tl.load(state).to(tl.float32)
    for t0 in range(bos, eos, BT):
        rows = t0 + r
        valid = rows < eos
        q = tl.load(Q + rows[:, None] * sq + kh * DK + dk[None, :], mask=valid[:, None], other=0.0)
        q = _l2norm_rows(q.to(tl.float32), L2NORM) * scale
        k = tl.load(K + rows[:, None] * sk + kh * DK + dk[None, :], mask=valid[:, None], other=0.0)
        k = _l2norm_rows(k.to(tl.float32), L2NORM)
        wk = tl.load(WK + rows[:, None] * (H * DK) + h * DK + dk[None, :], mask=valid[:, None], other=0.0)
        wv = tl.load(WV + rows[:, None] * (H * DV) + h * DV + dv[None, :], mask=valid[:, None], other=0.0)
        gc = tl.load(GC + rows * H + h, mask=valid, other=0.0)
        last = tl.load(GC + (tl.minimum(t0 + BT, eos) - 1) * H + h)
        u = wv - tl.dot(wk, s, input_precision=PRECISION)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        attn = tl.where(incl, qk * tl.exp(tl.where(incl, gc[:, None] - gc[None, :], 0.0)), 0.0)
        o = tl.dot(q, s, input_precision=PRECISION) * tl.exp(gc)[:, None] + tl.dot(attn, u, input_precision=PRECISION)
        tl.store(O + rows[:, None] * so + h * DV + dv[None, :], o.to(O.dtype.element_ty), mask=valid[:, None])
        k_decayed = k * tl.exp(tl.where(valid, last - gc, 0.0))[:, None]
        s = s * tl.exp(last) + tl.dot(tl.trans(k_decayed), u, input_precision=PRECISION)
    tl.store(state, s.to(STATE.dtype.element_ty))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [tokens, heads, d] with each token's heads contiguous (a token stride is fine)."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    return x


def _setup(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_slots, block_v):
    n = gdn.check(q, k, v, g, beta, initial_state, cu_seqlens, state_slots)
    dk, dv = q.shape[-1], v.shape[-1]
    for name, d in (("K", dk), ("V", dv)):
        if d & (d - 1) or d < 16:
            raise ValueError(f"head size {name} must be a power of two >= 16, got {d}")
    block_v = min(block_v, dv)
    buf, slots, returned = gdn.state_buffer(q, v, initial_state, state_slots, n)
    if not buf.is_contiguous():
        raise ValueError("initial_state must be contiguous (states are updated in place)")
    qf, kf, vf, gf, bf, cu = gdn.packed(q, k, v, g, beta, cu_seqlens)
    qf, kf, vf = _rows(qf), _rows(kf), _rows(vf)
    gf, bf = gf.contiguous(), bf.contiguous()
    out = torch.empty(vf.shape, dtype=q.dtype, device=q.device)
    scale = dk ** -0.5 if scale is None else scale
    return n, qf, kf, vf, gf, bf, cu, buf, slots, returned, out, scale, block_v


def gated_delta_rule_triton_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                      use_qk_l2norm_in_kernel=False, cu_seqlens=None, state_slots=None,
                                      block_v=32, num_warps=4):
    n, qf, kf, vf, gf, bf, cu, buf, slots, returned, out, scale, block_v = _setup(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, state_slots, block_v)
    h, dk, dv = vf.shape[1], qf.shape[2], vf.shape[2]
    if n and vf.shape[0]:
        _recurrent_kernel[(dv // block_v, n, h)](
            qf, kf, vf, gf, bf, out, buf, slots, cu, scale, qf.stride(0), kf.stride(0), vf.stride(0), gf.stride(0),
            out.stride(0), H=h, GROUP=h // qf.shape[1], DK=dk, DV=dv, BV=block_v, L2NORM=use_qk_l2norm_in_kernel,
            num_warps=num_warps)
    return out.reshape(v.shape), (buf if returned and output_final_state else None)


def gated_delta_rule_triton_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, state_slots=None,
                                  chunk_size=64, block_v=32, num_warps=4):
    n, qf, kf, vf, gf, bf, cu, buf, slots, returned, out, scale, block_v = _setup(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, state_slots, block_v)
    total, h = vf.shape[:2]
    dk, dv = qf.shape[2], vf.shape[2]
    if chunk_size & (chunk_size - 1) or chunk_size < 16:
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    if n and total:
        # which sequence each chunk belongs to and where it starts, computed on the device: the grid
        # is an upper bound (every sequence may end with a partial chunk) and surplus programs exit
        lens = cu[1:] - cu[:-1]
        ends = torch.cumsum((lens + chunk_size - 1) // chunk_size, 0)
        bound = total // chunk_size + n
        ids = torch.arange(bound, device=q.device)
        chunk_seq = torch.searchsorted(ends, ids, right=True)
        first = torch.nn.functional.pad(ends, (1, 0))[chunk_seq.clamp(max=n - 1)]
        chunk_start = cu[chunk_seq.clamp(max=n - 1)] + (ids - first) * chunk_size
        wk = torch.empty(total, h, dk, dtype=torch.float32, device=q.device)
        wv = torch.empty(total, h, dv, dtype=torch.float32, device=q.device)
        gc = torch.empty(total, h, dtype=torch.float32, device=q.device)
        precision = triton_env.dot_precision(q.dtype)
        common = dict(H=h, GROUP=h // qf.shape[1], DK=dk, DV=dv, BT=chunk_size, BV=block_v,
                      L2NORM=use_qk_l2norm_in_kernel, PRECISION=precision, num_warps=num_warps)
        _chunk_prepare_kernel[(bound, h)](kf, vf, gf, bf, wk, wv, gc, chunk_seq, chunk_start, cu, n,
                                          kf.stride(0), vf.stride(0), gf.stride(0), **common)
        _chunk_scan_kernel[(dv // block_v, n, h)](qf, kf, wk, wv, gc, out, buf, slots, cu, scale,
                                                  qf.stride(0), kf.stride(0), out.stride(0), **common)
    return out.reshape(v.shape), (buf if returned and output_final_state else None)
