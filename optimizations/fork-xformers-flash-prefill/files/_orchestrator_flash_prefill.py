"""Tries the vendor's flash-attention prefill before a fork's SDPA fallback in the xformers backend.

Deployed by the fork-xformers-flash-prefill plugin, which decorates the backend's
``_run_sdpa_fallback`` with :func:`flash_first`. ``ixformer.functions.flash_attn_func(q, k, v,
causal=True)`` was verified on the fork with head size 256 and GQA. Only calls whose query, key and
value are 4-D SDPA tensors [batch, heads, tokens, head_size] are tried; everything else, and every
call after a failure, goes to the original method.
"""
import functools
import logging

_logger = logging.getLogger(__name__)
_failure = None


def _flash(query, key, value):
    from ixformer import functions as ixf_F

    # SDPA's [batch, heads, tokens, d] <-> flash-attention's [batch, tokens, heads, d]
    out = ixf_F.flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=True)
    return out.transpose(1, 2)


def flash_first(fallback):
    @functools.wraps(fallback)
    def run(self, query, key, value, *args, **kwargs):
        global _failure
        if _failure is None and query.dim() == key.dim() == value.dim() == 4 and not args and not kwargs:
            try:
                return _flash(query, key, value)
            except Exception as exc:
                _failure = f"{type(exc).__name__}: {exc}"
                _logger.warning("flash-attention prefill failed; using the SDPA fallback from now on: %s", _failure)
        return fallback(self, query, key, value, *args, **kwargs)
    return run
