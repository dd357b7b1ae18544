"""The Gated DeltaNet layer's convolution, gates and gated RMSNorm, one Triton kernel each (contracts:
``kernels/gdn_ops.py``; the torch fallbacks in ``kernels/gdn_ops_torch.py``).

In a 16-bit decode step these replace 27 small torch ops per layer (gathers, casts, elementwise ops
and scatters) by three launches; all compute in float32 and round once. None reads anything back to
the host, and the convolution reaches each sequence's state through the slot tensor on the device:
a decode step can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from kernels import gdn_ops, triton_env

import triton  # noqa: E402  (after triton_env: see its docstring)
import triton.language as tl  # noqa: E402


@triton_env.jit_per_step("T")
def _conv_kernel(X, W, STATE, SLOTS, CU, OUT, sxb, sxt, sob, sot, T, C,
                 WIDTH: tl.constexpr, W_PAD: tl.constexpr, VARLEN: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """One (channel block, sequence): its tokens a block at a time, each output from the W inputs up
    to it (those before the sequence from its state), then the state's new W - 1 inputs. This
    program alone reads and writes its slice of the state."""
    cb, n = tl.program_id(0), tl.program_id(1)
    if VARLEN:  # packed along T
        bos, eos = tl.load(CU + n).to(tl.int64), tl.load(CU + n + 1).to(tl.int64)
        x_base, o_base = X, OUT
    else:  # sequence n is row n of [B, T]
        bos, eos = 0, T
        x_base, o_base = X + n.to(tl.int64) * sxb, OUT + n.to(tl.int64) * sob
    slot = tl.load(SLOTS + n).to(tl.int64)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cok = c < C
    state = STATE + slot * C * (WIDTH - 1) + c * (WIDTH - 1)
    r = tl.arange(0, BLOCK_T)
    for t0 in range(bos, eos, BLOCK_T):
        t = t0 + r
        tok = (t < eos)[:, None] & cok[None, :]
        rows = x_base + t[:, None] * sxt + c[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            # tap j reads input t - (W - 1) + j: a row of x, or before the sequence its state's column t - bos + j
            in_x = (t + j >= bos + WIDTH - 1)[:, None]
            xv = tl.load(rows + (j - (WIDTH - 1)) * sxt, mask=tok & in_x, other=0.0)
            sv = tl.load(state[None, :] + (t - bos + j)[:, None], mask=tok & ~in_x, other=0.0)
            w = tl.load(W + c * WIDTH + j, mask=cok, other=0.0).to(tl.float32)
            acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(o_base + t[:, None] * sot + c[None, :], out.to(OUT.dtype.element_ty), mask=tok)
    # the new state: column j holds input eos - (W - 1) + j, from x or (short sequences) the old state
    j = tl.arange(0, W_PAD)
    src = eos - (WIDTH - 1) + j
    keep = (j < WIDTH - 1)[:, None] & cok[None, :]
    xv = tl.load(x_base + src[:, None] * sxt + c[None, :], mask=keep & (src >= bos)[:, None], other=0.0)
    sv = tl.load(state[None, :] + (src - bos + WIDTH - 1)[:, None], mask=keep & (src < bos)[:, None], other=0.0)
    new = tl.where((src >= bos)[:, None], xv.to(STATE.dtype.element_ty), sv)
    tl.debug_barrier()  # every thread's reads of the old state are done before any of it is overwritten
    tl.store(state[None, :] + j[:, None], new, mask=keep)


def causal_conv1d_triton(x, weight, conv_state, state_slots, cu_seqlens=None, block_c=256, num_warps=4):
    """One program per ``block_c`` channels of a sequence, walking its tokens 64 at a time (one in a
    decode step); prefills take narrower channel blocks (1,024 elements a tile), which also gives a
    long sequence many programs."""
    n = gdn_ops.check_conv(x, weight, conv_state, state_slots, cu_seqlens)
    b, t, c = x.shape
    width = weight.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n and t:
        block_t = min(64, triton_env.pow2(t))
        block_c = min(block_c, triton_env.pow2(c), max(16, 1024 // block_t))
        cu = cu_seqlens if cu_seqlens is not None else state_slots  # unread without cu_seqlens
        _conv_kernel[(triton.cdiv(c, block_c), n)](
            x, weight.contiguous(), conv_state, state_slots, cu, out, x.stride(0), x.stride(1), out.stride(0),
            out.stride(1), t, c, WIDTH=width, W_PAD=triton_env.pow2(width - 1), VARLEN=cu_seqlens is not None,
            BLOCK_T=block_t, BLOCK_C=block_c, num_warps=num_warps, num_stages=1)
    return out


@triton.jit
def _softplus(x):
    """torch's softplus (linear above 20); log1p(e^-|x|) exact to float32 far into the tails."""
    y = tl.exp(-tl.abs(x))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * y / tl.where(u == 1.0, 1.0, u - 1.0))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)


@triton_env.jit_per_step("tokens")
def _gating_kernel(A, B, A_LOG, DT_BIAS, G, BETA, sa, sb, tokens,
                   H: tl.constexpr, H_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h = tl.arange(0, H_PAD)
    ok = (t < tokens)[:, None] & (h < H)[None, :]
    a = tl.load(A + t[:, None] * sa + h[None, :], mask=ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(DT_BIAS + h, mask=h < H, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(A_LOG + h, mask=h < H, other=0.0).to(tl.float32))
    g = -decay[None, :] * _softplus(a + dt_bias[None, :])
    tl.store(G + t[:, None] * H + h[None, :], g.to(G.dtype.element_ty), mask=ok)
    b = tl.load(B + t[:, None] * sb + h[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(BETA + t[:, None] * H + h[None, :], (1.0 / (1.0 + tl.exp(-b))).to(BETA.dtype.element_ty), mask=ok)


def gdn_gating_triton(a, b, A_log, dt_bias, block_t=None):
    """``block_t`` tokens per program (default: about 2,048 elements)."""
    gdn_ops.check_gating(a, b, A_log, dt_bias)
    tokens, h = a.shape
    g = torch.empty((tokens, h), dtype=gdn_ops.decay_dtype(a.dtype), device=a.device)
    beta = torch.empty((tokens, h), dtype=b.dtype, device=b.device)
    if tokens:
        h_pad = triton_env.pow2(h)
        block_t = block_t or min(max(1, 2048 // h_pad), triton_env.pow2(tokens))
        _gating_kernel[(triton.cdiv(tokens, block_t),)](a, b, A_log, dt_bias, g, beta, a.stride(0), b.stride(0),
                                                        tokens, H=h, H_PAD=h_pad, BLOCK_T=block_t, num_warps=4)
    return g, beta


@triton_env.jit_per_step("rows")
def _norm_gated_kernel(X, Z, W, OUT, sxt, sxh, szt, szh, rows, eps,
                       H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """BLOCK_R (token, head) rows of D channels."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    tok, head = r // H, r % H
    d = tl.arange(0, D_PAD)
    ok = (r < rows)[:, None] & (d < D)[None, :]
    x = tl.load(X + (tok * sxt + head * sxh)[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    w = tl.load(W + d, mask=d < D, other=0.0).to(tl.float32)
    z = tl.load(Z + (tok * szt + head * szh)[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :] * (z / (1.0 + tl.exp(-z)))
    tl.store(OUT + r[:, None] * D + d[None, :], y.to(OUT.dtype.element_ty), mask=ok)


def rms_norm_gated_triton(x, gate, weight, eps, block_r=None):
    """``block_r`` (token, head) rows per program (default: about 4,096 elements)."""
    gdn_ops.check_norm_gated(x, gate, weight)
    tokens, h, d = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = tokens * h
    if rows:
        d_pad = triton_env.pow2(d)
        block_r = block_r or min(max(1, 4096 // d_pad), triton_env.pow2(rows))
        _norm_gated_kernel[(triton.cdiv(rows, block_r),)](
            x, gate, weight, out, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), rows, eps,
            H=h, D=d, D_PAD=d_pad, BLOCK_R=block_r, num_warps=4)
    return out
