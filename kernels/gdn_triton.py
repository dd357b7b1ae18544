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


@triton_env.jit_per_step("T")
def _recurrent_kernel(Q, K, V, G, BETA, O, STATE, SLOTS, CU, T, scale, sq, sk, sv, sg, so,
                      H: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BV: tl.constexpr, L2NORM: tl.constexpr, VARLEN: tl.constexpr):
    vb, n, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if VARLEN:  # packed: the bounds from cu_seqlens
        bos, eos = tl.load(CU + n).to(tl.int64), tl.load(CU + n + 1).to(tl.int64)
    else:  # sequence n is row n of [B, T]
        bos = n.to(tl.int64) * T
        eos = bos + T
    slot = tl.load(SLOTS + n).to(tl.int64)
    kh = h // GROUP
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    state = STATE + slot * (H * DK * DV) + h * (DK * DV) + dk[:, None] * DV + dv[None, :]
    s = tl.load(state).to(tl.float32)
    for t64 in range(bos, eos):  # int64 bounds: so are the offsets below
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


@triton_env.jit_per_step("num_seqs")
def _chunk_prepare_kernel(Q, K, V, G, BETA, QN, KN, WK, WV, GC, CHUNK_SEQ, CHUNK_START, CU, num_seqs, sq, sk, sv, sg,
                          H: tl.constexpr, HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr,
                          DV: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                          PRECISION: tl.constexpr, LOG2_BT: tl.constexpr, INV_PRECISION: tl.constexpr):
    """One chunk of one head: its cumulative decay, (I + L)^-1, W_k and W_v;
    the first value head of each key head also writes the chunk's normalised q and k. All of them
    in WK's dtype: the operands the scan's dots take as they are."""
    c, h = tl.program_id(0), tl.program_id(1)
    n = tl.load(CHUNK_SEQ + c)
    if n < num_seqs:  # the grid is an upper bound of the chunk count
        DOT = WK.dtype.element_ty
        kh = h // GROUP
        start = tl.load(CHUNK_START + c).to(tl.int64)
        eos = tl.load(CU + n + 1)
        r = tl.arange(0, BT)
        rows = start + r
        valid = rows < eos
        dk = tl.arange(0, DK)
        k = tl.load(K + rows[:, None] * sk + kh * DK + dk[None, :], mask=valid[:, None], other=0.0)
        k = _l2norm_rows(k.to(tl.float32), L2NORM)
        if h % GROUP == 0:
            tl.store(KN + rows[:, None] * (HK * DK) + kh * DK + dk[None, :], k.to(DOT), mask=valid[:, None])
            q = tl.load(Q + rows[:, None] * sq + kh * DK + dk[None, :], mask=valid[:, None], other=0.0)
            q = _l2norm_rows(q.to(tl.float32), L2NORM)
            tl.store(QN + rows[:, None] * (HK * DK) + kh * DK + dk[None, :], q.to(DOT), mask=valid[:, None])
        g = tl.load(G + rows * sg + h, mask=valid, other=0.0).to(tl.float32)
        beta = tl.load(BETA + rows * sg + h, mask=valid, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, 0)  # padded rows have g = 0: their decay stays the last real row's
        strict = r[:, None] > r[None, :]
        kd = k.to(DOT)
        kk = tl.dot(kd, tl.trans(kd), input_precision=PRECISION)
        kb = (k * (beta * tl.exp(gc))[:, None]).to(DOT)  # W_k's right side; k's float32 copy ends here
        lower = tl.where(strict, beta[:, None] * tl.exp(tl.where(strict, gc[:, None] - gc[None, :], 0.0)) * kk, 0.0)
        # (I + L)^-1 by recursive blocking, all in whole-tile dots: with E the inverse of every diagonal
        # block of size h, each block of size 2h, [[A, 0], [C, B]], has the inverse
        # [[A^-1, 0], [-B^-1 C A^-1, B^-1]], i.e. E - E C E with C the lower-left quadrants
        inv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
        for level in tl.static_range(LOG2_BT):
            half = 1 << level
            quadrant = ((r[:, None] // (2 * half)) == (r[None, :] // (2 * half))) & (
                (r[:, None] // half) > (r[None, :] // half))
            corner = tl.dot(inv, tl.where(quadrant, lower, 0.0), input_precision=INV_PRECISION)
            inv = inv - tl.dot(corner, inv, input_precision=INV_PRECISION)
        inv = inv.to(DOT)
        wk = tl.dot(inv, kb, input_precision=PRECISION)
        tl.store(WK + rows[:, None] * (H * DK) + h * DK + dk[None, :], wk.to(DOT), mask=valid[:, None])
        tl.store(GC + rows * H + h, gc, mask=valid)
        for v0 in tl.static_range(0, DV, BV):
            dv = v0 + tl.arange(0, BV)
            v = tl.load(V + rows[:, None] * sv + h * DV + dv[None, :], mask=valid[:, None], other=0.0)
            wv = tl.dot(inv, (v.to(tl.float32) * beta[:, None]).to(DOT), input_precision=PRECISION)
            tl.store(WV + rows[:, None] * (H * DV) + h * DV + dv[None, :], wv.to(DOT), mask=valid[:, None])


@triton.jit
def _chunk_scan_kernel(QN, KN, WK, WV, GC, O, STATE, SLOTS, CU, scale, so,
                       H: tl.constexpr, HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    """One value block of one sequence's head, chunk after chunk: U = W_v - W_k S, the outputs
    scale (exp(c) Q S + (Q K^T * D) U), then S = exp(c_last) S + K^T (exp(c_last - c) U). The state
    stays float32 in registers; every tile a dot reads is taken as loaded (16-bit inputs: 16-bit
    operands, float32 sums), the decays and the scale go on the small results instead."""
    vb, n, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    DOT = WK.dtype.element_ty
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
        q = tl.load(QN + rows[:, None] * (HK * DK) + kh * DK + dk[None, :], mask=valid[:, None], other=0.0)
        k = tl.load(KN + rows[:, None] * (HK * DK) + kh * DK + dk[None, :], mask=valid[:, None], other=0.0)
        wk = tl.load(WK + rows[:, None] * (H * DK) + h * DK + dk[None, :], mask=valid[:, None], other=0.0)
        wv = tl.load(WV + rows[:, None] * (H * DV) + h * DV + dv[None, :], mask=valid[:, None], other=0.0)
        last = tl.load(GC + (tl.minimum(t0 + BT, eos) - 1) * H + h)
        gc = tl.load(GC + rows * H + h, mask=valid, other=0.0)
        gc = tl.where(valid, gc, last)  # rows past the end: no decay past the last row, nothing overflows
        sd = s.to(DOT)
        u = wv.to(tl.float32) - tl.dot(wk, sd, input_precision=PRECISION)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        attn = tl.where(incl, qk * tl.exp(gc[:, None] - gc[None, :]), 0.0)
        o = tl.dot(q, sd, input_precision=PRECISION) * tl.exp(gc)[:, None] \
            + tl.dot(attn.to(DOT), u.to(DOT), input_precision=PRECISION)
        tl.store(O + rows[:, None] * so + h * DV + dv[None, :], (o * scale).to(O.dtype.element_ty),
                 mask=valid[:, None])
        u_decayed = (u * tl.exp(last - gc)[:, None]).to(DOT)
        s = s * tl.exp(last) + tl.dot(tl.trans(k), u_decayed, input_precision=PRECISION)
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
    qf, kf, vf, gf, bf = gdn.packed(q, k, v, g, beta)
    qf, kf, vf = _rows(qf), _rows(kf), _rows(vf)
    gf, bf = gf.contiguous(), bf.contiguous()
    out = torch.empty(vf.shape, dtype=q.dtype, device=q.device)
    scale = dk ** -0.5 if scale is None else scale
    return n, qf, kf, vf, gf, bf, buf, slots, returned, out, scale, block_v


# the recurrent kernel's launch parameters by the state's element size: the tiles that streamed the
# Qwen3.6 decode step (32 heads of 128 x 128, batch 128 and 256) fastest on an H100 (BENCHMARKS.md, "The
# recurrence's launch parameters"): a float32 state in 64-column blocks of 4 warps, a 16-bit one in 32-column
# blocks of a single warp (the block's 8 KiB; more warps only split its rows finer); others as before
RECURRENT_LAUNCH = {4: (64, 4), 2: (32, 1)}


def recurrent_launch(state_dtype: torch.dtype, block_v=None, num_warps=None) -> tuple[int, int]:
    """(block_v, num_warps) of the recurrent kernel for a state of ``state_dtype``; arguments given pin theirs."""
    bv, warps = RECURRENT_LAUNCH.get(state_dtype.itemsize, (32, 4))
    return block_v or bv, num_warps or warps


def gated_delta_rule_triton_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                      use_qk_l2norm_in_kernel=False, cu_seqlens=None, state_slots=None,
                                      block_v=None, num_warps=None):
    block_v, num_warps = recurrent_launch(gdn.state_dtype(q, initial_state), block_v, num_warps)
    n, qf, kf, vf, gf, bf, buf, slots, returned, out, scale, block_v = _setup(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, state_slots, block_v)
    h, dk, dv = vf.shape[1], qf.shape[2], vf.shape[2]
    if n and vf.shape[0]:
        # B sequences of T tokens find their bounds from T: no tensor of bounds to build (a decode step)
        cu = slots if cu_seqlens is None else cu_seqlens
        _recurrent_kernel[(dv // block_v, n, h)](
            qf, kf, vf, gf, bf, out, buf, slots, cu, q.shape[1], scale, qf.stride(0), kf.stride(0), vf.stride(0),
            gf.stride(0), out.stride(0), H=h, GROUP=h // qf.shape[1], DK=dk, DV=dv, BV=block_v,
            L2NORM=use_qk_l2norm_in_kernel, VARLEN=cu_seqlens is not None, num_warps=num_warps)
    return out.reshape(v.shape), (buf if returned and output_final_state else None)


def _scan_shared(chunk: int, dk: int, block_v: int, stages: int, elt: int) -> int:
    """Shared memory of the scan kernel, estimated from its tiles (bytes, on the high side): the
    q, k and W_k tiles ``[chunk, dk]`` and the W_v tile, one set per pipeline stage, plus the state
    and value blocks converted for the dots."""
    loads = stages * (3 * chunk * dk + chunk * block_v) * elt
    return loads + (dk * block_v + 2 * chunk * block_v) * elt + 4096


def _prepare_shared(chunk: int, dk: int, block_v: int, elt: int) -> int:
    """Shared memory of the prepare kernel: k and the decayed keys as dot operands, the float32
    operands of the inverse's dots, one value block."""
    return 2 * chunk * dk * elt + 3 * chunk * chunk * 4 + chunk * block_v * elt + 2048


def chunk_configs(dk: int, dv: int, dtype: torch.dtype, programs: int, device: torch.device, chunk_size=None,
                  block_v=None, num_warps=None, num_stages=None, prepare_warps=None) -> list[dict]:
    """Launch configurations of ``triton_chunk``, best first, each within the device's shared memory.

    ``programs`` (sequences x value heads) sets the value block: the scan walks each sequence's
    chunks in order, so its parallelism is programs x dv / block_v; narrower blocks while that is
    below the SM count (and for float32, whose dots keep whole tiles in registers). Then 64-token chunks with a two-stage pipeline, falling back to fewer
    stages and shorter chunks as the tiles (head sizes, float32) outgrow the shared memory.
    Arguments given pin that parameter.
    """
    elt = 4 if dtype not in (torch.float16, torch.bfloat16) else 2
    limit = triton_env.max_shared_mem(device)
    if block_v is None:
        wide = elt == 2 and programs * max(1, dv // 32) >= triton_env.num_sms(device)
        block_v = 32 if wide else 16
    block_v = max(16, min(block_v, dv))
    out = []
    # float32 dots are exact (ieee) on the FMA units, every output element a register: short chunks
    # and no second pipeline stage keep them from spilling
    chunks = [chunk_size] if chunk_size else [64, 32, 16] if elt == 2 else [32, 16]
    for chunk in chunks:
        for stages in [num_stages] if num_stages else [2, 1] if elt == 2 else [1]:
            if max(_scan_shared(chunk, dk, block_v, stages, elt),
                   _prepare_shared(chunk, dk, min(dv, 64), elt)) > limit:
                continue
            warps = num_warps or (8 if dk * block_v * 4 > 128 * 32 * 4 else 4)
            out.append(dict(chunk_size=chunk, block_v=block_v, num_warps=warps, num_stages=stages,
                            prepare_warps=prepare_warps or (8 if chunk * dk >= 64 * 256 else 4)))
    if not out:  # pinned parameters that do not fit: let the device say so
        out.append(dict(chunk_size=chunk_size or 16, block_v=block_v, num_warps=num_warps or 4,
                        num_stages=num_stages or 1, prepare_warps=prepare_warps or 4))
    return out


_CHUNK_LAUNCH = triton_env.FirstThatFits()


def gated_delta_rule_triton_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, state_slots=None,
                                  chunk_size=None, block_v=None, num_warps=None, num_stages=None,
                                  prepare_warps=None):
    """Launch parameters left None are chosen by :func:`chunk_configs` for the device."""
    n, qf, kf, vf, gf, bf, buf, slots, returned, out, scale, _ = _setup(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, state_slots, 16)
    cu = gdn.bounds(q.shape[0], q.shape[1], cu_seqlens, q.device)
    total, h = vf.shape[:2]
    hk, dk, dv = qf.shape[1], qf.shape[2], vf.shape[2]
    for name, x in (("chunk_size", chunk_size), ("block_v", block_v)):
        if x is not None and (x & (x - 1) or x < 16):
            raise ValueError(f"{name} must be a power of two >= 16, got {x}")
    if not (n and total):
        return out.reshape(v.shape), (buf if returned and output_final_state else None)
    configs = chunk_configs(dk, dv, q.dtype, n * h, q.device, chunk_size, block_v, num_warps, num_stages,
                            prepare_warps)
    dot_dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.float32
    # the inverse's dots: tf32 on tensor cores (ten mantissa bits: finer than the 16-bit W_k and W_v it
    # feeds), exact for float32 inputs
    inv_precision = "ieee" if dot_dtype == torch.float32 else "tf32"
    # the chunks' operands, each in the dtype the scan's dots take
    qn = torch.empty(total, hk, dk, dtype=dot_dtype, device=q.device)
    kn = torch.empty(total, hk, dk, dtype=dot_dtype, device=q.device)
    wk = torch.empty(total, h, dk, dtype=dot_dtype, device=q.device)
    wv = torch.empty(total, h, dv, dtype=dot_dtype, device=q.device)
    gc = torch.empty(total, h, dtype=torch.float32, device=q.device)

    def run(cfg):
        bt = cfg["chunk_size"]
        # which sequence each chunk belongs to and where it starts, computed on the device: the grid
        # is an upper bound (every sequence may end with a partial chunk) and surplus programs exit
        lens = cu[1:] - cu[:-1]
        ends = torch.cumsum((lens + bt - 1) // bt, 0)
        bound = total // bt + n
        ids = torch.arange(bound, device=q.device)
        chunk_seq = torch.searchsorted(ends, ids, right=True)
        first = torch.nn.functional.pad(ends, (1, 0))[chunk_seq.clamp(max=n - 1)]
        chunk_start = cu[chunk_seq.clamp(max=n - 1)] + (ids - first) * bt
        common = dict(H=h, HK=hk, GROUP=h // hk, DK=dk, DV=dv, BT=bt, PRECISION=triton_env.dot_precision(q.dtype))
        _chunk_prepare_kernel[(bound, h)](qf, kf, vf, gf, bf, qn, kn, wk, wv, gc, chunk_seq, chunk_start, cu, n,
                                          qf.stride(0), kf.stride(0), vf.stride(0), gf.stride(0), BV=min(dv, 64),
                                          L2NORM=use_qk_l2norm_in_kernel, num_warps=cfg["prepare_warps"],
                                          LOG2_BT=bt.bit_length() - 1, INV_PRECISION=inv_precision, **common)
        bv = cfg["block_v"]
        _chunk_scan_kernel[(dv // bv, n, h)](qn, kn, wk, wv, gc, out, buf, slots, cu, scale, out.stride(0), BV=bv,
                                             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common)

    _CHUNK_LAUNCH.launch(configs, run, key=(q.device, q.dtype, h, hk, dk, dv))
    return out.reshape(v.shape), (buf if returned and output_final_state else None)
