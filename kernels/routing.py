"""Top-k expert routing, shared by every MoE variant so that all of them pick the same experts.

With ``shared_experts`` = s, the last s experts of the weights are shared experts (Qwen2-MoE /
Qwen3-Next style): every token uses each, weighted by the sigmoid of its own column of the router
logits (the last s columns), so a shared expert runs in the same grouped GEMM as the routed ones.
The softmax top-k runs over the other columns.
"""
from __future__ import annotations

import torch


def check_moe(hidden_states, router_logits, w13, w2, top_k, shared_experts=0) -> tuple[int, int, int, int]:
    """Validate MoE operands; returns (tokens, hidden, experts, intermediate), shared experts counted."""
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [tokens, hidden], got {tuple(hidden_states.shape)}")
    t, h = hidden_states.shape
    if w13.dim() != 3 or w13.shape[2] != h or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [experts, 2*intermediate, {h}], got {tuple(w13.shape)}")
    e, i = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (e, h, i):
        raise ValueError(f"w2 must be [{e}, {h}, {i}], got {tuple(w2.shape)}")
    if tuple(router_logits.shape) != (t, e):
        raise ValueError(f"router_logits must be [{t}, {e}], got {tuple(router_logits.shape)}")
    if not 0 <= shared_experts < e:
        raise ValueError(f"shared_experts must be in 0..{e - 1}, got {shared_experts}")
    if not 1 <= top_k <= e - shared_experts:
        raise ValueError(f"top_k must be in 1..{e - shared_experts}, got {top_k}")
    return t, h, e, i


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          shared_experts: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k + s], expert ids int64 [T, k + s]): softmax in float32 over the routed
    experts, top-k, optional renormalisation; then the s shared experts with their sigmoid gates."""
    routed = router_logits.shape[1] - shared_experts
    probs = torch.softmax(router_logits[:, :routed].float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if shared_experts:
        shared_ids = torch.arange(routed, routed + shared_experts, device=ids.device).expand(ids.shape[0], -1)
        weights = torch.cat([weights, torch.sigmoid(router_logits[:, routed:].float())], dim=1)
        ids = torch.cat([ids, shared_ids], dim=1)
    return weights, ids


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): flat pair indices sorted by expert (stable) and the pairs per expert."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    # not torch.bincount: on CUDA it reads the maximum back to the host, stalling the launch queue
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def align_block_size(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``moe_align_block_size``: pairs grouped by expert, each group padded to a multiple of ``block_m``.

    Returns ``sorted_pairs`` (flat pair index per row, ``T*k`` for padding rows) and ``block_expert``
    (expert of each block of ``block_m`` rows, -1 for unused blocks). Sized by the upper bound
    ``T*k + E*(block_m-1)`` so that nothing waits on the device for the real size.
    """
    numel = ids.numel()
    order, counts = sort_by_expert(ids, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    expert_sorted = ids.flatten()[order]
    rank = torch.arange(numel, device=ids.device) - start[expert_sorted]
    rows = pad_start[expert_sorted] + rank
    cap = numel + num_experts * (block_m - 1)
    cap = (cap + block_m - 1) // block_m * block_m
    sorted_pairs = torch.full((cap,), numel, dtype=torch.int32, device=ids.device)
    sorted_pairs[rows] = order.to(torch.int32)
    blocks_end = torch.cumsum(padded // block_m, 0)
    block = torch.arange(cap // block_m, device=ids.device)
    block_expert = torch.searchsorted(blocks_end, block, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert
