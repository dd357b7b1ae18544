"""The Gated DeltaNet layer's convolution, gates and gated RMSNorm in PyTorch: what the engine ran
before the fused Triton kernels, kept as their fallback (contracts: ``kernels/gdn_ops.py``).

A decode step (``[B, 1]`` rows, no ``cu_seqlens``) reaches the states through the slot tensor only:
a handful of ops, no host sync, so it can be captured in a CUDA graph. Packed prefills read their
bounds on the host and convolve sequence by sequence.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import gdn, gdn_ops


def causal_conv1d(x, weight, conv_state, state_slots, cu_seqlens=None):
    gdn_ops.check_conv(x, weight, conv_state, state_slots, cu_seqlens)
    slots = state_slots.to(torch.int64)
    if x.shape[1] == 1 and cu_seqlens is None:  # one token per sequence: the window is the state and x
        window = torch.cat([conv_state.index_select(0, slots), x[:, 0, :, None]], dim=-1)
        out = (window * weight).sum(-1)
        conv_state.index_copy_(0, slots, window[..., 1:])
        return F.silu(out)[:, None]
    rows = x.reshape(-1, x.shape[2])
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    width = weight.shape[1]
    for i, (first, end) in enumerate(gdn.spans(x.shape[0], x.shape[1], cu_seqlens)):
        if first == end:  # an empty sequence keeps its state
            continue
        slot = slots[i:i + 1]
        seq = torch.cat([conv_state.index_select(0, slot)[0], rows[first:end].T], dim=-1)  # [C, W - 1 + n]
        out[first:end] = F.conv1d(seq[None], weight[:, None, :], groups=weight.shape[0])[0].T
        conv_state.index_copy_(0, slot, seq[None, :, seq.shape[1] - (width - 1):])
    return F.silu(out).view(x.shape)


def gdn_gating(a, b, A_log, dt_bias):
    gdn_ops.check_gating(a, b, A_log, dt_bias)
    dt = gdn_ops.decay_dtype(a.dtype)
    return -A_log.to(dt).exp() * F.softplus(a.to(dt) + dt_bias.to(dt)), torch.sigmoid(b)


def rms_norm_gated(x, gate, weight, eps):
    gdn_ops.check_norm_gated(x, gate, weight)
    y = F.rms_norm(x.float(), weight.shape, weight.float(), eps)
    return (y * F.silu(gate.float())).to(x.dtype)
