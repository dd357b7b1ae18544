"""The gated delta rule in PyTorch (float32): token by token, and chunked.

``recurrent`` walks the tokens one at a time, every sequence and head at once: a decode step is a
handful of small ops and no host sync, so it is the decode fallback. ``chunk`` is the chunkwise
form of flash-linear-attention and Hugging Face's ``torch_chunk_gated_delta_rule``: within a chunk of
C tokens the state's updates are solved for at once (the WY representation), so the only sequential
loop is over chunks. Packed (``cu_seqlens``) sequences are computed one after the other.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import gdn


def _heads(q, k, v, use_l2norm):
    """q and k in float32, normalised if asked, repeated to v's head count: [B, T, H, K]."""
    q, k = q.float(), k.float()
    if use_l2norm:
        q, k = gdn.l2norm(q), gdn.l2norm(k)
    group = v.shape[2] // q.shape[2]
    if group > 1:
        q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
    return q, k


def _recurrent(q, k, v, g, beta, s, scale):
    """q, k [B, T, H, K] float32, v [B, T, H, V], g and beta [B, T, H], s [B, H, K, V] float32."""
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - (k[:, t, :, None, :] @ s)[..., 0, :])
        s = s + k[:, t, :, :, None] * u[:, :, None, :]
        out[:, t] = scale * (q[:, t, :, None, :] @ s)[..., 0, :]
    return out, s


def _chunk(q, k, v, g, beta, s, scale, chunk):
    """As :func:`_recurrent`, a chunk of ``chunk`` tokens at a time.

    Within a chunk with cumulative log decay c_r, the values the state absorbs are
    U = W_v - W_k S with (I + L) W_v = beta*V, (I + L) W_k = beta*exp(c)*K and
    L_rs = beta_r exp(c_r - c_s) k_r.k_s (s < r); then O = exp(c) Q S + (Q K^T * D) U with
    D_rs = exp(c_r - c_s) (s <= r), and S' = exp(c_last) S + (K exp(c_last - c))^T U.
    """
    b, t, h, dk = q.shape
    if t == 0:
        return v.new_zeros(v.shape, dtype=torch.float32), s
    pad = -t % chunk
    q, k, v, g, beta = (F.pad(x.float().transpose(1, 2), (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
                        for x in (q, k, v, g, beta))  # [B, H, T', ...]; padded tokens have beta 0
    n = q.shape[2] // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk).cumsum(-1), beta.reshape(b, h, n, chunk)
    row = torch.arange(chunk, device=q.device)
    strict, incl = row[:, None] > row[None, :], row[:, None] >= row[None, :]
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~incl, float("-inf")).exp()  # D
    lower = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)  # L
    # (I + L)^-1 by forward substitution, row by row: X_i = -L_i - sum_{s<i} L_is X_s
    inv = -lower
    for i in range(1, chunk):
        inv[..., i, :i] = inv[..., i, :i] + (inv[..., i, :i, None] * inv[..., :i, :i]).sum(-2)
    inv = inv + torch.eye(chunk, device=q.device)
    w_v = inv @ (beta[..., None] * v)
    w_k = inv @ ((beta * g.exp())[..., None] * k)
    attn = (q @ k.transpose(-1, -2)) * decay
    out = torch.empty_like(v)
    for i in range(n):
        u = w_v[:, :, i] - w_k[:, :, i] @ s
        out[:, :, i] = (q[:, :, i] * g[:, :, i, :, None].exp()) @ s + attn[:, :, i] @ u
        last = g[:, :, i, -1, None, None]
        s = s * last.exp() + (k[:, :, i] * (last - g[:, :, i, :, None]).exp()).transpose(-1, -2) @ u
    out = out.reshape(b, h, n * chunk, -1)[:, :, :t].transpose(1, 2)
    return scale * out, s


def _run(core, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
         state_slots):
    n = gdn.check(q, k, v, g, beta, initial_state, cu_seqlens, state_slots)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    buf, slots, returned = gdn.state_buffer(q, v, initial_state, state_slots, n)
    qn, kn = _heads(q, k, v, use_qk_l2norm_in_kernel)
    if cu_seqlens is None:  # B sequences of T tokens at once: no host sync (a decode step stays graph-safe)
        out, s = core(qn, kn, v, g, beta, buf.index_select(0, slots).float(), scale)
        buf.index_copy_(0, slots, s.to(buf.dtype))
    else:
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for i, (a, b) in enumerate(gdn.spans(1, q.shape[1], cu_seqlens)):
            one = slice(a, b)
            o, s = core(qn[:, one], kn[:, one], v[:, one], g[:, one], beta[:, one],
                        buf[slots[i:i + 1]].float(), scale)
            out[:, one] = o
            buf.index_copy_(0, slots[i:i + 1], s.to(buf.dtype))
    return out.to(q.dtype), (buf if returned and output_final_state else None)


def gated_delta_rule_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, state_slots=None):
    return _run(_recurrent, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, state_slots)


def gated_delta_rule_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, state_slots=None, chunk_size=64):
    """``chunk_size`` tokens per chunk (fewer when every sequence is shorter)."""
    def core(q, k, v, g, beta, s, scale):
        return _chunk(q, k, v, g, beta, s, scale, max(1, min(chunk_size, q.shape[1])))
    return _run(core, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, state_slots)
