"""Turns the ``num_kv_heads`` integer vLLM passes into the head-mapping tensor an older native kernel wants.

Deployed by the fork-head-mapping-tensor plugin for forks whose V1 paged-attention call hands vLLM's
``num_kv_heads`` (an int) to a native kernel (``ixf_F.paged_attention_v1``) that expects
``head_mapping``: for each query head, the index of its KV head.
"""
import torch


def head_mapping(num_kv_heads, num_heads, device):
    """[num_heads] int32: query head h reads KV head h // (num_heads // num_kv_heads)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split evenly over {num_kv_heads} kv heads")
    return torch.repeat_interleave(torch.arange(num_kv_heads, dtype=torch.int32, device=device),
                                   num_heads // num_kv_heads)


def with_head_mapping(op):
    """``op`` called with its fifth positional argument converted from an int to a head mapping."""
    def call(out, query, key_cache, value_cache, heads, *args, **kwargs):
        if isinstance(heads, int):
            heads = head_mapping(heads, query.shape[1], query.device)
        return op(out, query, key_cache, value_cache, heads, *args, **kwargs)
    return call
