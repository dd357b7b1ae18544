"""The project's paged-decode kernels behind vLLM's ``paged_attention_v2`` arguments.

The decode plugins deploy a two-line shim into the vllm package that builds one of these; vLLM's
``_custom_ops.paged_attention_v2`` calls it first and runs its own CUDA kernel whenever it raises: at
once for inputs the kernel does not cover (ALiBi, an fp8 KV cache, block-sparse attention), and for
every later call once the kernel has failed (shared memory, compilation), so a broken kernel costs
one attempt, not one per step.
"""
from __future__ import annotations

import logging

_logger = logging.getLogger(__name__)


class PagedAttentionV2:
    def __init__(self, op: str, variant: str):
        self.op, self.variant = op, variant
        self.failure: str | None = None

    def __call__(self, out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                 alibi_slopes, kv_cache_dtype, blocksparse_vert_stride):
        name = f"{self.op}/{self.variant}"
        if self.failure is not None:
            raise RuntimeError(f"{name} disabled after an earlier failure: {self.failure}")
        if alibi_slopes is not None or kv_cache_dtype != "auto" or blocksparse_vert_stride > 1:
            raise NotImplementedError(f"{name} covers neither ALiBi, an fp8 KV cache nor block-sparse attention")
        if key_cache.shape[1] != num_kv_heads:
            raise NotImplementedError(f"key_cache holds {key_cache.shape[1]} kv heads, the call names {num_kv_heads}")
        try:
            import kernels

            out.copy_(kernels.get(self.op, self.variant)(query, key_cache, value_cache, block_tables, seq_lens, scale))
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            _logger.warning("project kernel %s failed; vLLM's own kernel is used from now on: %s", name, self.failure)
            raise
