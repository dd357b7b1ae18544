"""Rotary position embedding, NeoX style, on the first ``rotary_dim`` channels of each head
(Qwen3-Next rotates a quarter of its 256 channels). The angles are computed once per step and
shared by every layer."""
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
        """(cos, sin) as [tokens, 1, rotary_dim / 2] float32."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([tokens, heads, head_size]) by its tokens' angles."""
    rotary_dim = 2 * cos.shape[-1]
    x1, x2 = x[..., :rotary_dim].float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
