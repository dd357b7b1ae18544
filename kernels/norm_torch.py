"""RMSNorm (with the residual add folded in) and per-head q/k RMSNorm + rotary embedding in PyTorch:
what the engine ran before the fused Triton kernels, kept as their fallback.

``rms_norm(x, weight, eps, residual=None)``: ``norm(x)``; with ``residual``, ``(norm(x + residual),
x + residual)``, the sum rounded to the input dtype first (the next layer's residual).

``qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps)``: q ``[tokens, heads, head_size]`` and k
``[tokens, kv_heads, head_size]`` (any strides, the last dim contiguous) each RMS-normalised per head
with their weight, then the first ``2 * cos.shape[-1]`` channels rotated NeoX style by the tokens'
angles (``cos``, ``sin`` float32 ``[tokens, rotary_dim / 2]``). Returns new contiguous (q, k).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def check_rms_norm(x, weight, residual) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [tokens, hidden] and weight [hidden], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")


def check_qk_norm_rope(q, k, q_weight, k_weight, cos, sin) -> int:
    """Validate the operands; returns the rotary dim."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [tokens, heads, d] and k [tokens, kv_heads, d] do not match: {tuple(q.shape)}, {tuple(k.shape)}")
    t, _, d = q.shape
    if q_weight.shape != (d,) or k_weight.shape != (d,):
        raise ValueError(f"q_weight and k_weight must be [{d}], got {tuple(q_weight.shape)}, {tuple(k_weight.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != t or not 0 < 2 * cos.shape[1] <= d:
        raise ValueError(f"cos and sin must be [{t}, rotary_dim / 2] with rotary_dim <= {d}, got {tuple(cos.shape)}")
    return 2 * cos.shape[1]


def rms_norm(x, weight, eps, residual=None):
    check_rms_norm(x, weight, residual)
    if residual is None:
        return F.rms_norm(x, weight.shape, weight, eps)
    x = x + residual
    return F.rms_norm(x, weight.shape, weight, eps), x


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first ``2 * cos.shape[-1]`` channels of ``x`` [tokens, heads, d], in float32."""
    rotary_dim = 2 * cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :rotary_dim].float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
    check_qk_norm_rope(q, k, q_weight, k_weight, cos, sin)
    q = F.rms_norm(q, q_weight.shape, q_weight, eps)
    k = F.rms_norm(k, k_weight.shape, k_weight, eps)
    return rotate(q, cos, sin), rotate(k, cos, sin)
