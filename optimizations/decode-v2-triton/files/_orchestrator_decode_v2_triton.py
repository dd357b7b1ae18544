"""Deployed into the vllm package by the decode-v2-triton plugin: vLLM's ``paged_attention_v2`` tries the
project's Triton V2 decode kernel first (kernels/vllm_adapter.py says how it falls back)."""
from kernels.vllm_adapter import PagedAttentionV2

OP, VARIANT = "paged_decode", "v2_triton"

_adapter = PagedAttentionV2(OP, VARIANT)


def paged_attention_v2(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                       alibi_slopes, kv_cache_dtype, blocksparse_vert_stride):
    _adapter(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
             alibi_slopes, kv_cache_dtype, blocksparse_vert_stride)
