"""Kernel choices of the example deployment."""
DECODE_LONG = "python"   # kernel for decode beyond 8192 tokens: python | v2_layout
PREFILL_TILE = 64
