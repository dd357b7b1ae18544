"""The contracts of the Gated DeltaNet layer's small ops around the recurrence, shared by their
variants: argument checks (``ValueError`` naming the argument) and the sequences' bounds.

    out = causal_conv1d(x, weight, conv_state, state_slots, cu_seqlens=None)

SiLU of the causal depthwise convolution of each sequence's inputs, continuing from its state. x
``[B, T, C]`` (any strides, channels contiguous) holds B sequences of T tokens, or with
``cu_seqlens`` (int ``[N + 1]``, B = 1) N sequences packed along T; weight ``[C, W]`` (taps oldest
first); conv_state ``[slots, C, W - 1]`` is a pool of states: sequence n starts from the W - 1 inputs
before it in ``conv_state[state_slots[n]]`` (oldest first; the slots distinct) and leaves its own last W - 1 inputs there,
in place; no other slot is touched. ``out[t, c] = silu(sum_j weight[c, j] * input[t - W + 1 + j, c])``,
``[B, T, C]`` in x's dtype.

    g, beta = gdn_gating(a, b, A_log, dt_bias)

Each token's per-head log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32, or float64 for
float64 inputs; softplus linear above 20 as torch's) and write strength ``beta = sigmoid(b)`` (b's dtype). a, b ``[tokens, H]`` (any
row stride, heads contiguous); A_log, dt_bias ``[H]``.

    out = rms_norm_gated(x, gate, weight, eps)

Qwen3-Next's ``RMSNormGated``: each ``[d]`` row of x ``[tokens, heads, d]`` RMS-normalised, times
weight ``[d]``, times SiLU(gate) (gate x's shape, any strides with d contiguous), in float32, cast
to x's dtype; a new contiguous tensor.
"""
from __future__ import annotations

import torch


def _int_tensor(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != shape or t.is_floating_point():
        raise ValueError(f"{name} must be an integer tensor {list(shape)}, got {tuple(t.shape)} {t.dtype}")


def check_conv(x, weight, conv_state, state_slots, cu_seqlens) -> int:
    """Validate the operands; returns the number of sequences."""
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"x must be [B, T, channels] with contiguous channels, got {tuple(x.shape)}")
    b, _, c = x.shape
    if weight.dim() != 2 or weight.shape[0] != c or weight.shape[1] < 2:
        raise ValueError(f"weight must be [{c}, width >= 2], got {tuple(weight.shape)}")
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (c, weight.shape[1] - 1):
        raise ValueError(f"conv_state must be [slots, {c}, {weight.shape[1] - 1}], got {tuple(conv_state.shape)}")
    if not conv_state.is_contiguous():
        raise ValueError("conv_state must be contiguous (states are updated in place)")
    if cu_seqlens is not None:
        if b != 1 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens [N + 1] packs sequences along T of x with B = 1, got x {tuple(x.shape)}"
                             f" and cu_seqlens {tuple(cu_seqlens.shape)}")
        _int_tensor("cu_seqlens", cu_seqlens, (cu_seqlens.numel(),))
        n = cu_seqlens.numel() - 1
    else:
        n = b
    _int_tensor("state_slots", state_slots, (n,))
    return n


def check_gating(a, b, A_log, dt_bias) -> None:
    if a.dim() != 2 or b.shape != a.shape or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"a and b must be [tokens, heads] with contiguous heads, got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}")
    h = a.shape[1]
    if A_log.shape != (h,) or dt_bias.shape != (h,):
        raise ValueError(f"A_log and dt_bias must be [{h}], got {tuple(A_log.shape)}, {tuple(dt_bias.shape)}")


def check_norm_gated(x, gate, weight) -> None:
    if x.dim() != 3 or gate.shape != x.shape or x.stride(2) != 1 or gate.stride(2) != 1:
        raise ValueError(f"x and gate must be [tokens, heads, d] with d contiguous, got {tuple(x.shape)}, "
                         f"{tuple(gate.shape)}")
    if weight.shape != (x.shape[2],):
        raise ValueError(f"weight must be [{x.shape[2]}], got {tuple(weight.shape)}")


def decay_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``gdn_gating``'s g for activations of ``dtype``: float32 (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)

