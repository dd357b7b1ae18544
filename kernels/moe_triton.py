"""MoE as two grouped GEMMs in Triton over expert-aligned row blocks, in the manner of vLLM's fused_moe.

``routing.align_block_size`` groups the token-expert pairs by expert and pads every expert's group
to a multiple of BLOCK_M, so that each program's rows share one expert. The first kernel computes
gate and up projections together and writes ``silu(gate) * up``; the second applies the down
projection and the routing weight; a sum over each token's top-k rows gives the output.
"""
from __future__ import annotations

import torch

from kernels import triton_env
from kernels.routing import align_block_size, check_moe, route

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


def _config(num_pairs: int, num_experts: int) -> dict:
    """Small row blocks when experts see few tokens (decode: weight streaming), larger when they see many."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def moe_triton(hidden_states, router_logits, w13, w2, top_k, renormalize=True, config=None):
    """``config`` overrides the block sizes (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    tokens, hidden, num_experts, inter = check_moe(hidden_states, router_logits, w13, w2, top_k)
    weights, ids = route(router_logits, top_k, renormalize)
    num_pairs = tokens * top_k
    cfg = {**_config(num_pairs, num_experts), **(config or {})}
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    launch = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"], TOP_K=top_k, PRECISION=triton_env.dot_precision(hidden_states.dtype))
    x = hidden_states.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    pairs, block_expert = align_block_size(ids, num_experts, block_m)
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
    return y.view(tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(hidden_states.dtype)
