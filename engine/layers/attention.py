"""Paged attention: write the new tokens' K/V into the cache, then run the chosen kernels.

The caches use vLLM's layouts: key [blocks, kv_heads, head_size/x, block_size, x] with
x = 16 bytes / element size, value [blocks, kv_heads, head_size, block_size].
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.kernel_choice import Kernels


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    """Store token i's K/V ([tokens, kv_heads, head_size]) at ``offsets[i]`` of block ``blocks[i]``."""
    t, kvh, d = key.shape
    x = key_cache.shape[-1]
    key_cache[blocks, :, :, offsets, :] = key.reshape(t, kvh, d // x, x)
    value_cache[blocks, :, :, offsets] = value


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, kernels: Kernels):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = head_size ** -0.5
        self.kernels = kernels
        self.key_cache: torch.Tensor | None = None  # set by the model runner
        self.value_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        kc, vc = self.key_cache, self.value_cache
        write_kv(k, v, kc, vc, meta.slot_blocks, meta.slot_offsets)
        parts = []
        for group, kernel in ((meta.decode, self.kernels.decode), (meta.decode_long, self.kernels.decode_long)):
            if group is not None:
                parts.append(kernel(q[group.start:group.end], kc, vc, group.block_tables, group.seq_lens,
                                    self.scale))
        p = meta.prefill
        if p is not None:
            parts.append(self.kernels.prefill(q[p.start:], k[p.start:], v[p.start:], kc, vc, p.block_tables,
                                              p.query_start_loc, p.context_lens, self.scale,
                                              **self.kernels.prefill_kwargs))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
