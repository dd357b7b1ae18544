"""RMSNorm with the residual add folded in, and per-head q/k RMSNorm + rotary embedding, each one
Triton kernel (see ``kernels/norm_torch.py`` for the contracts they share with their fallbacks).

Both compute in float32 from the inputs' dtype; the residual sum is rounded to that dtype before
it is normalised, as the unfused add would round it.
"""
from __future__ import annotations

import torch

from kernels import triton_env
from kernels.norm_torch import check_qk_norm_rope, check_rms_norm

import triton  # noqa: E402  (after triton_env: see its docstring)
import triton.language as tl  # noqa: E402


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, RES_OUT, sx, sr, so, sro, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(X + row * sx + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + row * sr + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(RES_OUT + row * sro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * so + cols, (xf * rstd * w).to(OUT.dtype.element_ty), mask=ok)


def rms_norm_triton(x, weight, eps, residual=None):
    check_rms_norm(x, weight, residual)
    tokens, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if tokens:
        block = triton_env.pow2(n)
        r = residual if residual is not None else x
        _rms_norm_kernel[(tokens,)](x, r, weight, out, res_out, x.stride(0), r.stride(0), out.stride(0),
                                    res_out.stride(0), n, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
                                    num_warps=8 if block >= 2048 else 4)
    return out if residual is None else (out, res_out)


@triton.jit
def _qk_norm_rope_kernel(Q, K, QW, KW, COS, SIN, QO, KO, sq0, sq1, sk0, sk1, sqo0, sqo1, sko0, sko1, sc0, ss0, eps,
                         HQ: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr):
    """One (token, head): heads below HQ are query heads, the rest kv heads."""
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if h < HQ:
        src, dst, w_ptr = Q + t * sq0 + h * sq1, QO + t * sqo0 + h * sqo1, QW
    else:
        src, dst, w_ptr = K + t * sk0 + (h - HQ) * sk1, KO + t * sko0 + (h - HQ) * sko1, KW
    i = tl.arange(0, D_PAD)
    ok = i < D
    x = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    y = x * rstd * tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
    # NeoX rotation: channel i < HALF pairs with i + HALF, HALF <= i < 2 HALF with i - HALF
    rot = i < 2 * HALF
    first = i < HALF
    j = tl.where(first, i + HALF, tl.where(rot, i - HALF, i))
    yp = tl.load(src + j, mask=ok, other=0.0).to(tl.float32) * rstd * tl.load(w_ptr + j, mask=ok, other=0.0).to(tl.float32)
    a = tl.where(first, i, i - HALF)
    c = tl.load(COS + t * sc0 + a, mask=rot, other=1.0)
    s = tl.load(SIN + t * ss0 + a, mask=rot, other=0.0)
    out = tl.where(rot, y * c + tl.where(first, -yp, yp) * s, y)
    tl.store(dst + i, out.to(QO.dtype.element_ty), mask=ok)


def qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps):
    check_qk_norm_rope(q, k, q_weight, k_weight, cos, sin)
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k must be contiguous along head_size")
    tokens, hq, d = q.shape
    hk = k.shape[1]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens:
        _qk_norm_rope_kernel[(tokens, hq + hk)](
            q, k, q_weight, k_weight, cos, sin, qo, ko, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos.stride(0), sin.stride(0), eps,
            HQ=hq, D=d, D_PAD=triton_env.pow2(d), HALF=cos.shape[1], num_warps=1 if d <= 128 else 2)
    return qo, ko
