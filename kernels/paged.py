"""vLLM's paged KV-cache layouts and the gathers every torch variant shares.

key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x]   (x = 16 // element_size)
value_cache [num_blocks, num_kv_heads, head_size, block_size]
"""
from __future__ import annotations

import torch


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> int:
    """Validate the two caches against the query's geometry; returns the block size."""
    if key_cache.dim() != 5:
        raise ValueError(f"key_cache must be 5-D [blocks, kv_heads, head_size//x, block_size, x], got {tuple(key_cache.shape)}")
    if value_cache.dim() != 4:
        raise ValueError(f"value_cache must be 4-D [blocks, kv_heads, head_size, block_size], got {tuple(value_cache.shape)}")
    nb, kvh, dx, bs, x = key_cache.shape
    if kvh != num_kv_heads or dx * x != head_size:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} does not hold {num_kv_heads} kv heads of size {head_size}")
    if tuple(value_cache.shape) != (nb, kvh, head_size, bs):
        raise ValueError(f"value_cache {tuple(value_cache.shape)} does not match key_cache {tuple(key_cache.shape)}")
    return bs


def to_block_major(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both caches as [blocks, kv_heads, block_size, head_size], as the seed's V2 patch converts them.

    K is a permute and reshape (a copy, since the permuted view is not contiguous); V a transpose and copy.
    """
    nb, kvh, dx, bs, x = key_cache.shape
    k = key_cache.permute(0, 1, 3, 2, 4).reshape(nb, kvh, bs, dx * x)
    v = value_cache.permute(0, 1, 3, 2).contiguous()
    return k, v


def safe_tables(block_tables: torch.Tensor, lens: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """The first ``num_blocks`` columns as int64, entries past each row's last used block set to 0.

    Padding entries of a block table may hold anything; indexing with them must not fault.
    """
    bt = block_tables[:, :num_blocks].long()
    used = (lens.long() + block_size - 1) // block_size
    cols = torch.arange(num_blocks, device=bt.device)
    return torch.where(cols[None, :] < used[:, None], bt, torch.zeros_like(bt))


def gather_native(key_cache: torch.Tensor, value_cache: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks in ``tables`` [rows, n] as [rows, kv_heads, n * block_size, head_size]."""
    rows, n = tables.shape
    _, kvh, dx, bs, x = key_cache.shape
    k = key_cache[tables].permute(0, 2, 1, 4, 3, 5).reshape(rows, kvh, n * bs, dx * x)
    v = value_cache[tables].permute(0, 2, 1, 4, 3).reshape(rows, kvh, n * bs, dx * x)
    return k, v


def gather_block_major(k_blocks: torch.Tensor, v_blocks: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`gather_native`, from caches already in [blocks, kv_heads, block_size, head_size]."""
    rows, n = tables.shape
    _, kvh, bs, d = k_blocks.shape
    k = k_blocks[tables].permute(0, 2, 1, 3, 4).reshape(rows, kvh, n * bs, d)
    v = v_blocks[tables].permute(0, 2, 1, 3, 4).reshape(rows, kvh, n * bs, d)
    return k, v
