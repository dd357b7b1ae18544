"""vLLM's own Triton decode attention, run on this project's decode workloads: the yardstick of ``v2_triton``.

vLLM ships a split-KV Triton decode kernel (``decode_attention_fwd`` in ``triton_decode_attention``; a grouped
variant runs the query heads that share a KV head together, as ``v2_triton`` does). It reads the Triton backends'
cache layout, ``[blocks, block_size, kv_heads, head_size]`` for K and V alike, where this project's kernels read
vLLM's ``paged_attention`` layout (K ``[blocks, kv_heads, head_size / x, block_size, x]``, V ``[blocks, kv_heads,
head_size, block_size]``): the caches are converted once, outside any timing, so that both kernels read the same
tokens. vLLM is imported only where it is installed (on the GPU machine, the vLLM payload); the kernel is not
this project's and is never shipped with it.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

# where vLLM keeps it since its V1 engine (0.34.0 among them); the older V0 module's call lacks the lse and scales
MODULES = ("vllm.v1.attention.ops.triton_decode_attention",)
SPLITS = (4, 8, 16, 32)  # the KV splits a comparison tries: vLLM's backends choose theirs per batch


def find() -> tuple[Callable | None, str]:
    """vLLM's ``decode_attention_fwd`` and the module it came from; else None and why not."""
    why = []
    for name in MODULES:
        try:
            return importlib.import_module(name).decode_attention_fwd, name
        except Exception as exc:  # not installed, or this vLLM lays its modules out otherwise
            why.append(f"{name}: {type(exc).__name__}: {exc}")
    return None, "; ".join(why)


def nhd_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged_attention layout's caches as the Triton backends lay them out: ``[blocks, block_size, kv_heads,
    head_size]`` each, contiguous copies."""
    blocks, heads, _, block_size, _ = key_cache.shape
    k = key_cache.permute(0, 3, 1, 2, 4).reshape(blocks, block_size, heads, -1).contiguous()
    v = value_cache.permute(0, 3, 1, 2).contiguous()
    return k, v


def prepared(fwd: Callable, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_kv_splits: int = 8,
             **_) -> Callable[[], torch.Tensor]:
    """A call of vLLM's ``fwd`` on a decode workload (``kernels.inputs.paged_decode``'s arguments): its caches
    converted and its buffers allocated here, once, so that a timing of the call sees the kernels alone. The
    call returns the attention output ``[seqs, heads, head_size]``."""
    k, v = nhd_caches(key_cache, value_cache)
    seqs, heads, head_size = query.shape
    out = torch.empty_like(query)
    lse = torch.empty(seqs, heads, dtype=torch.float32, device=query.device)
    logits = torch.empty(seqs, heads, num_kv_splits, head_size + 1, dtype=torch.float32, device=query.device)
    tables, lens = block_tables.to(torch.int32), seq_lens.to(torch.int32)
    unit = torch.ones((), dtype=torch.float32, device=query.device)  # K and V unscaled, made here: a CUDA graph's
    # capture allows no host-to-device copy, which the kernel's own default would make at every call

    def call() -> torch.Tensor:
        fwd(query, k, v, out, lse, tables, lens, logits, num_kv_splits, scale, page_size=k.shape[1], k_scale=unit,
            v_scale=unit)
        return out

    return call
