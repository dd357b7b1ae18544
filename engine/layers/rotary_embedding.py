"""Rotary position embedding, NeoX style, on the first ``rotary_dim`` channels of each head
(Qwen3-Next rotates a quarter of its 256 channels). The angles are computed once per step and
shared by every layer; the rotation itself is part of the ``qk_norm_rope`` kernel."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, base: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) as [tokens, rotary_dim / 2] float32."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()
