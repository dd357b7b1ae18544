"""MoE as two grouped GEMMs in Triton over expert-aligned row blocks, in the manner of vLLM's fused_moe.

One kernel routes (softmax, top-k, renormalisation and the shared experts' sigmoid gates, see
``routing.route``); one more groups the token-expert pairs by expert and pads every expert's group
to a multiple of BLOCK_M (vLLM's ``moe_align_block_size``: histogram, prefix sum, scatter, in a
single program), so that each GEMM program's rows share one expert. The first GEMM computes gate
and up projections together and writes ``silu(gate) * up``; the second applies the down projection
and the routing weight; a sum over each token's rows gives the output. Five launches, none of
which waits on the device, so the whole MoE can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from kernels import triton_env
from kernels.routing import align_block_size, check_moe

import triton  # noqa: E402  (after triton_env: see its docstring)
import triton.language as tl  # noqa: E402


@triton.jit
def _grouped_gemm(A, W, OUT, PAIRS, BLOCK_EXPERT, ROUTE_W, num_pairs, n_out, k_in,
                  sa0, sw0, sw1, so0, gate_off,
                  TOP_K: tl.constexpr, GATED: tl.constexpr, A_IS_TOKENS: tl.constexpr, EVEN_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """OUT[pair] = act(A[row] @ W[e]ᵀ) for the BLOCK_M pairs of one expert block, one BLOCK_N column tile.

    GATED: W holds gate rows then up rows (``gate_off`` apart); writes silu(gate) * up.
    Otherwise the result is multiplied by the pair's routing weight.
    """
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(BLOCK_EXPERT + pid_m)
    if expert >= 0:
        pairs = tl.load(PAIRS + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        live = pairs < num_pairs
        if A_IS_TOKENS:
            a_row = pairs // TOP_K
        else:
            a_row = pairs
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_out
        k = tl.arange(0, BLOCK_K)
        a_ptr = A + a_row[:, None].to(tl.int64) * sa0 + k[None, :]
        w_ptr = W + expert.to(tl.int64) * sw0 + cols[None, :].to(tl.int64) * sw1 + k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if GATED:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            if EVEN_K:  # no mask along k: the loads stay full-width vectors
                k_ok = k < BLOCK_K
            else:
                k_ok = k + k0 < k_in
            a = tl.load(a_ptr, mask=live[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GATED:
                w_up = tl.load(w_ptr + gate_off * sw1, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
            a_ptr += BLOCK_K
            w_ptr += BLOCK_K
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        else:
            acc = acc * tl.load(ROUTE_W + pairs, mask=live, other=0.0)[:, None]
        tl.store(OUT + pairs[:, None].to(tl.int64) * so0 + cols[None, :], acc.to(OUT.dtype.element_ty),
                 mask=live[:, None] & col_ok[None, :])


@triton.jit
def _route_kernel(LOGITS, WEIGHTS, IDS, tokens, sl0, ROUTED: tl.constexpr, E_PAD: tl.constexpr,
                  TOP_K: tl.constexpr, SHARED: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_T: tl.constexpr):
    """``routing.route`` for BLOCK_T tokens: weights float32 and expert ids int32, [tokens, TOP_K + SHARED]."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < tokens
    e = tl.arange(0, E_PAD)
    routed = (e < ROUTED)[None, :]
    logit = tl.load(LOGITS + t[:, None].to(tl.int64) * sl0 + e[None, :], mask=t_ok[:, None] & routed, other=0.0)
    logit = tl.where(routed, logit.to(tl.float32), float("-inf"))
    m = tl.max(logit, 1)
    denom = tl.sum(tl.exp(logit - m[:, None]), 1)
    k = tl.arange(0, K_PAD)[None, :]
    weights = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    work = logit
    for j in tl.static_range(TOP_K):  # the largest remaining logit is the largest remaining probability
        best = tl.max(work, 1)
        idx = tl.min(tl.where(work == best[:, None], e[None, :], E_PAD), 1)
        weights = tl.where(k == j, (tl.exp(best - m) / denom)[:, None], weights)
        ids = tl.where(k == j, idx[:, None], ids)
        work = tl.where(e[None, :] == idx[:, None], float("-inf"), work)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    for s in tl.static_range(SHARED):
        g = tl.load(LOGITS + t.to(tl.int64) * sl0 + ROUTED + s, mask=t_ok, other=0.0).to(tl.float32)
        weights = tl.where(k == TOP_K + s, (1.0 / (1.0 + tl.exp(-g)))[:, None], weights)
        ids = tl.where(k == TOP_K + s, ROUTED + s, ids)
    ok = t_ok[:, None] & (k < TOP_K + SHARED)
    out = t[:, None] * (TOP_K + SHARED) + k
    tl.store(WEIGHTS + out, weights, mask=ok)
    tl.store(IDS + out, ids, mask=ok)


@triton.jit
def _align_kernel(IDS, SORTED, BLOCK_EXPERT, numel, cap, num_blocks,
                  E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """``routing.align_block_size`` in one program: per-expert counts, padded prefix sums, then each
    pair scattered to its expert's next row (rows of one expert in pair order)."""
    e = tl.arange(0, E_PAD)
    c = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], tl.int32)
    for p0 in range(0, numel, CHUNK):
        ids = tl.load(IDS + p0 + c, mask=p0 + c < numel, other=E_PAD)
        counts += tl.sum((ids[None, :] == e[:, None]).to(tl.int32), 1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    for r0 in range(0, cap, CHUNK):
        tl.store(SORTED + r0 + c, tl.zeros([CHUNK], tl.int32) + numel, mask=r0 + c < cap)
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + c  # the expert of block b: how many experts' padded groups end at or before its first row
        owner = tl.sum(((pad_end[None, :] <= (b * BLOCK_M)[:, None]) & (e < E)[None, :]).to(tl.int32), 1)
        tl.store(BLOCK_EXPERT + b, tl.where(owner < E, owner, -1), mask=b < num_blocks)
    tl.debug_barrier()  # the padding fill above lands before the scatter below overwrites it
    seen = tl.zeros([E_PAD], tl.int32)
    for p0 in range(0, numel, CHUNK):
        p = p0 + c
        ok = p < numel
        ids = tl.load(IDS + p, mask=ok, other=E_PAD)
        match = ids[None, :] == e[:, None]  # [E_PAD, CHUNK]
        earlier = tl.sum(((ids[:, None] == ids[None, :]) & (c[None, :] < c[:, None])).to(tl.int32), 1)
        row = tl.sum(tl.where(match, (pad_start + seen)[:, None], 0), 0) + earlier
        tl.store(SORTED + row, p, mask=ok)
        seen += tl.sum(match.to(tl.int32), 1)


ALIGN_ONE_PROGRAM_MAX = 16384  # pairs; above, the multi-launch torch alignment is faster


def route_triton(router_logits, top_k: int, renormalize: bool, shared_experts: int = 0):
    """(weights float32, expert ids int32), [tokens, top_k + shared_experts], in one launch."""
    tokens, total = router_logits.shape
    routed, k = total - shared_experts, top_k + shared_experts
    weights = torch.empty(tokens, k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, k, dtype=torch.int32, device=router_logits.device)
    if tokens:
        block_t = 16
        _route_kernel[(triton.cdiv(tokens, block_t),)](
            router_logits, weights, ids, tokens, router_logits.stride(0), ROUTED=routed,
            E_PAD=triton_env.pow2(routed), TOP_K=top_k, SHARED=shared_experts, K_PAD=triton_env.pow2(k),
            RENORMALIZE=renormalize, BLOCK_T=block_t, num_warps=4)
    return weights, ids


def align_triton(ids, num_experts: int, block_m: int):
    """``routing.align_block_size`` (same outputs, same upper-bound sizes) in one launch."""
    numel = ids.numel()
    cap = numel + num_experts * (block_m - 1)
    cap = (cap + block_m - 1) // block_m * block_m
    sorted_pairs = torch.empty(cap, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(cap // block_m, dtype=torch.int32, device=ids.device)
    _align_kernel[(1,)](ids, sorted_pairs, block_expert, numel, cap, cap // block_m, E=num_experts,
                        E_PAD=triton_env.pow2(num_experts), BLOCK_M=block_m, CHUNK=32, num_warps=8)
    return sorted_pairs, block_expert


def _config(num_pairs: int, num_experts: int) -> dict:
    """Launch configuration by rows per expert. Under one row per expert (decode of a few tokens) the
    GEMMs stream weights: narrow N tiles give more programs to stream them with. Small row blocks
    while experts see few tokens, larger when they see many."""
    per_expert = num_pairs / num_experts
    if per_expert <= 0.5:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def moe_triton(hidden_states, router_logits, w13, w2, top_k, renormalize=True, shared_experts=0, config=None):
    """``config`` overrides the launch configuration (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    tokens, hidden, num_experts, inter = check_moe(hidden_states, router_logits, w13, w2, top_k, shared_experts)
    weights, ids = route_triton(router_logits, top_k, renormalize, shared_experts)
    k = top_k + shared_experts
    num_pairs = tokens * k
    cfg = {**_config(num_pairs, num_experts), **(config or {})}
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    launch = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"], TOP_K=k, PRECISION=triton_env.dot_precision(hidden_states.dtype))
    x = hidden_states.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    if num_pairs <= ALIGN_ONE_PROGRAM_MAX:
        pairs, block_expert = align_triton(ids, num_experts, block_m)
    else:
        pairs, block_expert = align_block_size(ids.long(), num_experts, block_m)
    act = x.new_empty(num_pairs, inter)
    _grouped_gemm[(block_expert.numel(), triton.cdiv(inter, block_n))](
        x, w13, act, pairs, block_expert, weights, num_pairs, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), inter,
        GATED=True, A_IS_TOKENS=True, EVEN_K=hidden % launch["BLOCK_K"] == 0, **launch)
    y = x.new_empty(num_pairs, hidden)
    _grouped_gemm[(block_expert.numel(), triton.cdiv(hidden, block_n))](
        act, w2, y, pairs, block_expert, weights, num_pairs, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0), 0,
        GATED=False, A_IS_TOKENS=False, EVEN_K=inter % launch["BLOCK_K"] == 0, **launch)
    return y.view(tokens, k, hidden).sum(dim=1)  # accumulates in float32, rounds once
