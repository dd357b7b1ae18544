"""Plain float64 definitions of the ops: what every other variant is checked against.

Each computes in float64 and returns the query's / hidden states' dtype, so the reference is also a
usable (slow) variant; pass float64 inputs to get the full-precision answer.
"""
from __future__ import annotations

import torch

from kernels import gdn, gdn_ops
from kernels.routing import check_moe, route


def _context(key_cache, value_cache, table, n):
    """The first ``n`` tokens' K and V of one sequence, [kv_heads, n, head_size] each, block by block."""
    bs = key_cache.shape[3]
    ks, vs = [], []
    for i in range((n + bs - 1) // bs):
        blk = int(table[i])
        k = key_cache[blk].permute(0, 2, 1, 3)  # [kvh, bs, d//x, x]
        ks.append(k.reshape(k.shape[0], bs, -1))
        vs.append(value_cache[blk].transpose(1, 2))  # [kvh, bs, d]
    kvh, d = value_cache.shape[1], value_cache.shape[2]
    if not ks:
        return (key_cache.new_zeros(kvh, 0, d, dtype=torch.float64), value_cache.new_zeros(kvh, 0, d, dtype=torch.float64))
    return torch.cat(ks, 1)[:, :n].double(), torch.cat(vs, 1)[:, :n].double()


def _attend(q, k, v, mask=None):
    """softmax(q kᵀ) v for q [H, m, d] over k, v [H, n, d]; ``mask`` [m, n] True where allowed."""
    s = q @ k.transpose(1, 2)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    num_seqs, num_heads, d = query.shape
    group = num_heads // key_cache.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64, device=query.device)
    for s in range(num_seqs):
        k, v = _context(key_cache, value_cache, block_tables[s], int(seq_lens[s]))
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        q = query[s].double()[:, None, :] * scale  # [H, 1, d]
        out[s] = _attend(q, k, v)[:, 0]
    return out.to(query.dtype)


def prefix_prefill(query, key, value, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
                   block_m=None, block_n=None, num_warps=None):
    num_heads = query.shape[1]
    group = num_heads // key.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64, device=query.device)
    for s in range(len(context_lens)):
        a, b, c = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(context_lens[s])
        n = b - a
        ck, cv = _context(key_cache, value_cache, block_tables[s], c)
        k = torch.cat([ck, key[a:b].double().transpose(0, 1)], 1).repeat_interleave(group, 0)
        v = torch.cat([cv, value[a:b].double().transpose(0, 1)], 1).repeat_interleave(group, 0)
        q = query[a:b].double().transpose(0, 1) * scale  # [H, n, d]
        row = torch.arange(n, device=query.device)[:, None]
        col = torch.arange(c + n, device=query.device)[None, :]
        out[a:b] = _attend(q, k, v, col <= c + row).transpose(0, 1)
    return out.to(query.dtype)


def moe(hidden_states, router_logits, w13, w2, top_k, renormalize=True, shared_experts=0):
    """Token by token; routing is the shared float32 routing, so the experts chosen match every variant."""
    _, _, _, inter = check_moe(hidden_states, router_logits, w13, w2, top_k, shared_experts)
    weights, ids = route(router_logits, top_k, renormalize, shared_experts)
    out = torch.zeros(hidden_states.shape, dtype=torch.float64, device=hidden_states.device)
    for t in range(hidden_states.shape[0]):
        x = hidden_states[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e].double() @ x
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(weights[t, j]) * (w2[e].double() @ act)
    return out.to(hidden_states.dtype)


def _rms64(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def rms_norm(x, weight, eps, residual=None):
    if residual is None:
        return _rms64(x, weight, eps).to(x.dtype)
    s = x.double() + residual.double()
    return _rms64(s, weight, eps).to(x.dtype), s.to(x.dtype)


def _rope64(x, cos, sin):
    half = cos.shape[-1]
    cos, sin = cos.double()[:, None, :], sin.double()[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
    return (_rope64(_rms64(q, q_weight, eps), cos, sin).to(q.dtype),
            _rope64(_rms64(k, k_weight, eps), cos, sin).to(k.dtype))


def gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, state_slots=None):
    """Token by token, every head at once (the contract: ``kernels/gdn.py``)."""
    n = gdn.check(q, k, v, g, beta, initial_state, cu_seqlens, state_slots)
    qf, kf, vf, gf, bf = gdn.packed(q, k, v, g, beta)
    qf, kf, vf, gf, bf = (x.double() for x in (qf, kf, vf, gf, bf))
    if use_qk_l2norm_in_kernel:
        qf, kf = gdn.l2norm(qf), gdn.l2norm(kf)
    group = vf.shape[1] // qf.shape[1]
    qf, kf = qf.repeat_interleave(group, 1), kf.repeat_interleave(group, 1)  # [tokens, H, K]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    buf, slots, returned = gdn.state_buffer(q, v, initial_state, state_slots, n)
    out = torch.zeros(vf.shape, dtype=torch.float64, device=q.device)
    for i, (a, b) in enumerate(gdn.spans(*q.shape[:2], cu_seqlens)):
        slot = int(slots[i])
        s = buf[slot].double()  # [H, K, V]
        for t in range(a, b):
            s = s * gf[t].exp()[:, None, None]
            u = bf[t][:, None] * (vf[t] - (kf[t][:, None, :] @ s)[:, 0])  # v - S^T k, per head
            s = s + kf[t][:, :, None] * u[:, None, :]
            out[t] = scale * (qf[t][:, None, :] @ s)[:, 0]
        buf[slot] = s.to(buf.dtype)
    o = out.reshape(v.shape).to(q.dtype)
    return o, (buf if returned and output_final_state else None)


def causal_conv1d(x, weight, conv_state, state_slots, cu_seqlens=None):
    """Sequence by sequence, output by output (the contract: ``kernels/gdn_ops.py``)."""
    gdn_ops.check_conv(x, weight, conv_state, state_slots, cu_seqlens)
    rows, w = x.reshape(-1, x.shape[2]).double(), weight.double()
    width = w.shape[1]
    out = torch.empty(rows.shape, dtype=torch.float64, device=x.device)
    for i, (first, end) in enumerate(gdn.spans(x.shape[0], x.shape[1], cu_seqlens)):
        slot = int(state_slots[i])
        seq = torch.cat([conv_state[slot].double(), rows[first:end].T], dim=-1)  # [C, W - 1 + n]
        for t in range(end - first):
            out[first + t] = (seq[:, t:t + width] * w).sum(-1)
        conv_state[slot] = seq[:, seq.shape[1] - (width - 1):].to(conv_state.dtype)
    return torch.nn.functional.silu(out).view(x.shape).to(x.dtype)


def gdn_gating(a, b, A_log, dt_bias):
    gdn_ops.check_gating(a, b, A_log, dt_bias)
    x = a.double() + dt_bias.double()
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    g = -A_log.double().exp() * softplus
    return g.to(gdn_ops.decay_dtype(a.dtype)), torch.sigmoid(b.double()).to(b.dtype)


def rms_norm_gated(x, gate, weight, eps):
    gdn_ops.check_norm_gated(x, gate, weight)
    return (_rms64(x, weight, eps) * torch.nn.functional.silu(gate.double())).to(x.dtype)
