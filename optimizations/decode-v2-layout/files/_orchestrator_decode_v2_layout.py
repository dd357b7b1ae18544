"""Deployed into the vllm package by the decode-v2-layout plugin: vLLM's ``paged_attention_v2`` tries the
project's layout-converting V2 decode kernel first (kernels/vllm_adapter.py says how it falls back)."""
from kernels.vllm_adapter import PagedAttentionV2

OP, VARIANT = "paged_decode", "v2_layout"

paged_attention_v2 = PagedAttentionV2(OP, VARIANT)
