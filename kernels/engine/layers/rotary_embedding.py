"""Rotary position embedding, NeoX style, on the first ``rotary_dim`` channels of each head
(Qwen3-Next rotates a quarter of its 256 channels)."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, base: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, *heads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each of ``heads`` ([tokens, num_heads, head_size]) by its token's position."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        return tuple(self._rotate(x, cos, sin) for x in heads)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.rotary_dim].float(), x[..., self.rotary_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((rotated, rest), dim=-1)
