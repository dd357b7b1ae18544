"""The project's Triton prefix-prefill kernel behind vLLM's ``context_attention_fwd`` arguments.

Deployed into the vllm package by the prefill-triton plugin. vLLM's ``context_attention_fwd`` calls
this first and runs its own Triton kernel whenever it raises: at once for inputs the kernel does not
cover (ALiBi, sliding windows, attention sinks, fp8), and for every later call once the kernel has
failed (shared memory, a hang turned into an error), so a broken kernel costs one attempt.
"""
import logging

OP, VARIANT = "prefix_prefill", "triton"

_logger = logging.getLogger(__name__)
_failure = None


def context_attention_fwd(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len,
                          max_input_len, alibi_slopes, sliding_window, sm_scale, skip_decode, fp8_out_scale, sinks):
    global _failure
    if _failure is not None:
        raise RuntimeError(f"{OP}/{VARIANT} disabled after an earlier failure: {_failure}")
    if (alibi_slopes is not None or (sliding_window or 0) > 0 or sinks is not None
            or fp8_out_scale is not None or "fp8" in kv_cache_dtype):
        raise NotImplementedError(f"{OP}/{VARIANT} covers neither ALiBi, sliding windows, sinks nor fp8")
    try:
        import kernels
        import torch

        query_lens = b_start_loc[1:] - b_start_loc[:-1]
        scale = sm_scale if sm_scale is not None else q.shape[-1] ** -0.5
        # max_input_len sizes the grid without reading the device, so CUDA-graph capture stays possible
        out = kernels.get(OP, VARIANT)(q, k, v, k_cache, v_cache, b_loc, b_start_loc, b_seq_len - query_lens, scale,
                                       max_query_len=max_input_len)
        if skip_decode:  # vLLM leaves the rows of single-token queries to its decode kernel
            rows = torch.repeat_interleave(query_lens != 1, query_lens, output_size=q.shape[0])
            o[rows] = out[rows]
        else:
            o.copy_(out)
    except Exception as exc:
        _failure = f"{type(exc).__name__}: {exc}"
        _logger.warning("project kernel %s/%s failed; vLLM's own kernel is used from now on: %s", OP, VARIANT, _failure)
        raise
