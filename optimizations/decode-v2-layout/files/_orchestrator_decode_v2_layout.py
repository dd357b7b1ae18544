"""The project's layout-converting V2 paged-decode kernel behind vLLM's ``paged_attention_v2`` arguments.

Deployed into the vllm package by the decode-v2-layout plugin. vLLM's ``_custom_ops.paged_attention_v2``
calls this first and runs its own CUDA kernel whenever it raises: at once for inputs the kernel does
not cover (ALiBi, an fp8 KV cache, block-sparse attention), and for every later call once the kernel
has failed (an unsupported shape or device), so a broken kernel costs one attempt, not one per step.
"""
import logging

OP, VARIANT = "paged_decode", "v2_layout"

_logger = logging.getLogger(__name__)
_failure = None


def paged_attention_v2(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                       alibi_slopes, kv_cache_dtype, blocksparse_vert_stride):
    global _failure
    if _failure is not None:
        raise RuntimeError(f"{OP}/{VARIANT} disabled after an earlier failure: {_failure}")
    if alibi_slopes is not None or kv_cache_dtype != "auto" or blocksparse_vert_stride > 1:
        raise NotImplementedError(f"{OP}/{VARIANT} covers neither ALiBi, an fp8 KV cache nor block-sparse attention")
    if key_cache.shape[1] != num_kv_heads:
        raise NotImplementedError(f"key_cache holds {key_cache.shape[1]} kv heads, the call names {num_kv_heads}")
    try:
        import kernels

        out.copy_(kernels.get(OP, VARIANT)(query, key_cache, value_cache, block_tables, seq_lens, scale))
    except Exception as exc:
        _failure = f"{type(exc).__name__}: {exc}"
        _logger.warning("project kernel %s/%s failed; vLLM's own kernel is used from now on: %s", OP, VARIANT, _failure)
        raise
