"""MoE expert dispatch in PyTorch: the seed's per-expert gather and its sort-by-expert rewrite."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.routing import check_moe, route, sort_by_expert


def moe_gather(hidden_states, router_logits, w13, w2, top_k, renormalize=True, shared_experts=0):
    """The seed's baseline: for each used expert, index its scattered tokens out of the hidden states."""
    _, _, _, inter = check_moe(hidden_states, router_logits, w13, w2, top_k, shared_experts)
    weights, ids = route(router_logits, top_k, renormalize, shared_experts)
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = F.linear(hidden_states[tok], w13[e])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(act, w2[e])
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.to(hidden_states.dtype)


def moe_sorted(hidden_states, router_logits, w13, w2, top_k, renormalize=True, shared_experts=0):
    """Token-expert pairs sorted by expert: contiguous segments, one activation, one scatter-add."""
    _, _, num_experts, inter = check_moe(hidden_states, router_logits, w13, w2, top_k, shared_experts)
    weights, ids = route(router_logits, top_k, renormalize, shared_experts)
    order, counts = sort_by_expert(ids, num_experts)
    tok = order // ids.shape[1]
    x = hidden_states[tok]  # the one gather: rows of each expert are now contiguous
    gate_up = x.new_empty(x.shape[0], 2 * inter)
    bounds = torch.cumsum(counts, 0).tolist()
    segments = [(e, a, b) for e, (a, b) in enumerate(zip([0] + bounds[:-1], bounds)) if b > a]
    for e, a, b in segments:
        torch.mm(x[a:b], w13[e].t(), out=gate_up[a:b])
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = x.new_empty(x.shape[0], hidden_states.shape[1])
    for e, a, b in segments:
        torch.mm(act[a:b], w2[e].t(), out=y[a:b])
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    out.index_add_(0, tok, y.float() * weights.flatten()[order, None])
    return out.to(hidden_states.dtype)


def moe_grouped_mm(hidden_states, router_logits, w13, w2, top_k, renormalize=True, shared_experts=0):
    """The sorted dispatch with each projection as one ``torch._grouped_mm`` over all experts: no host sync."""
    _, _, num_experts, inter = check_moe(hidden_states, router_logits, w13, w2, top_k, shared_experts)
    weights, ids = route(router_logits, top_k, renormalize, shared_experts)
    order, counts = sort_by_expert(ids, num_experts)
    tok = order // ids.shape[1]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gate_up = torch._grouped_mm(hidden_states[tok], w13.transpose(1, 2), offs=offs)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    out.index_add_(0, tok, y.float() * weights.flatten()[order, None])
    return out.to(hidden_states.dtype)
