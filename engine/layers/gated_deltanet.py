"""Qwen3-Next / Qwen3.6's Gated DeltaNet layer (linear attention), as vLLM and Hugging Face run it.

One projection gives q, k, v (Hk key heads, H value heads) and the output gate z; another gives
beta (sigmoid: how much of each token to write) and a, from which the per-head log decay is
``g = -exp(A_log) * softplus(a + dt_bias)``. q, k and v go through a short causal depthwise
convolution (kernel 4) and SiLU; the gated delta rule (``kernels`` op ``gated_delta_rule``, with q and
k L2-normalised in the kernel) mixes them through each sequence's recurrent state; each head's output
is RMS-normalised and multiplied by SiLU(z), then projected back.

Both states live in per-sequence slots (``engine/state_cache.py``): ``conv_state`` holds the last
kernel - 1 convolution inputs, ``ssm_state`` the recurrent state. Decode rows reach their slots
through a device tensor only (no host sync, no shape that depends on the data). The convolution,
the gates and the gated norm are the ``gdn-fused`` kernels (one launch each with ``triton``), the
recurrence ``gdn-decode`` for single-token rows and ``gdn-prefill`` for packed prefill chunks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.kernel_choice import Kernels
from engine.model_config import ModelConfig


class RMSNormGated(nn.Module):
    """RMSNorm over each head's output, then times SiLU of the gate (Qwen3-Next's ``RMSNormGated``),
    through the chosen ``rms_norm_gated`` kernel."""

    def __init__(self, size: int, eps: float, kernels: Kernels):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size))
        self.kernels = kernels

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm_gated(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        h = cfg.hidden_size
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k, self.head_v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_conv_dim
        self.kernel_size = cfg.linear_conv_kernel_dim
        # both input projections in one GEMM: rows q, k, v, z (in_proj_qkvz), then b, a (in_proj_ba)
        self.in_proj = nn.Parameter(torch.empty(self.conv_dim + self.value_dim + 2 * self.num_v_heads, h))
        self.conv1d = nn.Parameter(torch.empty(self.conv_dim, self.kernel_size))  # taps oldest first
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = RMSNormGated(self.head_v, cfg.rms_norm_eps, kernels)
        self.out_proj = nn.Parameter(torch.empty(h, self.value_dim))
        self.kernels = kernels
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, kernel - 1], set by the model runner
        self.ssm_state: torch.Tensor | None = None  # [slots, value heads, K, V], mamba-ssm-cache-dtype

    @property
    def in_proj_qkvz(self) -> torch.Tensor:
        return self.in_proj[:self.conv_dim + self.value_dim]

    @property
    def in_proj_ba(self) -> torch.Tensor:
        return self.in_proj[self.conv_dim + self.value_dim:]

    def init_views(self) -> list[tuple[str, torch.Tensor]]:
        """The weights as two projections, in the order they were drawn in before they became one, so
        that a seed gives the same model."""
        rest = [(name, p) for name, p in self.named_parameters(recurse=False) if name != "in_proj"]
        return [("in_proj_qkvz", self.in_proj_qkvz), ("in_proj_ba", self.in_proj_ba)] + rest

    @torch.no_grad()
    def init_gates(self, gen: torch.Generator) -> None:
        """Decays from fast to slow across heads, as trained models have (a random ``A_log`` near 0
        would forget everything within a few tokens): A in [0.05, 1], dt_bias around 0."""
        a = torch.empty(self.A_log.shape, dtype=torch.float32, device=self.A_log.device).uniform_(0.05, 1.0, generator=gen)
        self.A_log.copy_(a.log())
        self.dt_bias.copy_(torch.randn(self.dt_bias.shape, generator=gen, device=self.dt_bias.device) * 0.5)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        st = meta.state
        t = x.shape[0]
        if st.fresh_slots is not None:  # sequences starting now: no history in their slots
            self.conv_state.index_fill_(0, st.fresh_slots, 0)
            self.ssm_state.index_fill_(0, st.fresh_slots, 0)
        mixed, z, b, a = F.linear(x, self.in_proj).split(
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        q, k, v = self._conv(mixed, st).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.view(t, self.num_k_heads, self.head_k), k.view(t, self.num_k_heads, self.head_k)
        v = v.view(t, self.num_v_heads, self.head_v)
        g, beta = self.kernels.gdn_gating(a, b, self.A_log, self.dt_bias)
        parts, nd = [], st.num_decode
        if nd:  # [sequences, 1 token]
            parts.append(self.kernels.gdn_decode(
                q[:nd, None], k[:nd, None], v[:nd, None], g[:nd, None], beta[:nd, None],
                initial_state=self.ssm_state, state_slots=st.decode_slots, use_qk_l2norm_in_kernel=True)[0][:, 0])
        if st.prefill_slots is not None:  # [1, packed tokens]
            parts.append(self.kernels.gdn_prefill(
                q[None, nd:], k[None, nd:], v[None, nd:], g[None, nd:], beta[None, nd:],
                initial_state=self.ssm_state, state_slots=st.prefill_slots, cu_seqlens=st.prefill_cu_seqlens,
                use_qk_l2norm_in_kernel=True)[0][0])
        o = parts[0] if len(parts) == 1 else torch.cat(parts)
        o = self.norm(o, z.view(t, self.num_v_heads, self.head_v))
        return F.linear(o.reshape(t, self.value_dim), self.out_proj)

    def _conv(self, mixed: torch.Tensor, st) -> torch.Tensor:
        """SiLU of the causal depthwise convolution of each sequence's inputs, continuing from (and
        updating) its slot's last kernel - 1 inputs: decode rows as [rows, 1], prefill chunks packed."""
        parts, nd, conv = [], st.num_decode, self.kernels.gdn_conv
        if nd:
            parts.append(conv(mixed[:nd, None], self.conv1d, self.conv_state, st.decode_slots)[:, 0])
        if st.prefill_slots is not None:
            parts.append(conv(mixed[None, nd:], self.conv1d, self.conv_state, st.prefill_slots,
                              st.prefill_cu_seqlens)[0])
        return parts[0] if len(parts) == 1 else torch.cat(parts)
