"""The project's attention, MoE and Gated DeltaNet kernels behind one lookup: ``variants(op)`` and ``get(op, variant)``.

Variants are registered by dotted path and imported on first use, so that asking for a torch
variant never imports Triton (which must see ``TRITON_INTERPRET`` before its first import).
"""
from __future__ import annotations

import importlib
import os
from typing import Callable

OPS = ("paged_decode", "prefix_prefill", "moe", "rms_norm", "qk_norm_rope", "gated_delta_rule", "causal_conv1d",
       "gdn_gating", "rms_norm_gated")

# op -> variant -> "module:function"; the first entry of each op is its float64 reference.
_REGISTRY: dict[str, dict[str, str]] = {
    "paged_decode": {
        "reference": "kernels.reference:paged_decode",
        "v1": "kernels.decode_torch:paged_decode_v1",
        "v2": "kernels.decode_torch:paged_decode_v2",
        "v2_layout": "kernels.decode_torch:paged_decode_v2_layout",
        "v2_triton": "kernels.decode_triton:paged_decode_v2_triton",
    },
    "prefix_prefill": {
        "reference": "kernels.reference:prefix_prefill",
        "loop": "kernels.prefill_torch:prefix_prefill_loop",
        "pregather": "kernels.prefill_torch:prefix_prefill_pregather",
        "triton": "kernels.prefill_triton:prefix_prefill_triton",
    },
    "moe": {
        "reference": "kernels.reference:moe",
        "gather": "kernels.moe_torch:moe_gather",
        "sorted": "kernels.moe_torch:moe_sorted",
        "grouped_mm": "kernels.moe_torch:moe_grouped_mm",
        "triton": "kernels.moe_triton:moe_triton",
    },
    "rms_norm": {
        "reference": "kernels.reference:rms_norm",
        "torch": "kernels.norm_torch:rms_norm",
        "triton": "kernels.norm_triton:rms_norm_triton",
    },
    "qk_norm_rope": {
        "reference": "kernels.reference:qk_norm_rope",
        "torch": "kernels.norm_torch:qk_norm_rope",
        "triton": "kernels.norm_triton:qk_norm_rope_triton",
    },
    "gated_delta_rule": {  # the contract: kernels/gdn.py
        "reference": "kernels.reference:gated_delta_rule",
        "recurrent": "kernels.gdn_torch:gated_delta_rule_recurrent",
        "chunk": "kernels.gdn_torch:gated_delta_rule_chunk",
        "triton_recurrent": "kernels.gdn_triton:gated_delta_rule_triton_recurrent",
        "triton_chunk": "kernels.gdn_triton:gated_delta_rule_triton_chunk",
    },
    # the Gated DeltaNet layer's ops around the recurrence (the contracts: kernels/gdn_ops.py)
    "causal_conv1d": {
        "reference": "kernels.reference:causal_conv1d",
        "torch": "kernels.gdn_ops_torch:causal_conv1d",
        "triton": "kernels.gdn_ops_triton:causal_conv1d_triton",
    },
    "gdn_gating": {
        "reference": "kernels.reference:gdn_gating",
        "torch": "kernels.gdn_ops_torch:gdn_gating",
        "triton": "kernels.gdn_ops_triton:gdn_gating_triton",
    },
    "rms_norm_gated": {
        "reference": "kernels.reference:rms_norm_gated",
        "torch": "kernels.gdn_ops_torch:rms_norm_gated",
        "triton": "kernels.gdn_ops_triton:rms_norm_gated_triton",
    },
}


# Variants that never wait on the device (no ``.item()``, ``.tolist()``, host-side maximum or
# data-dependent output size) as a decode step calls them: a CUDA graph can capture them. The gated
# delta rule's and the convolution's torch variants qualify there only (B sequences of one token,
# states by slot): with ``cu_seqlens`` they read the sequences' bounds on the host.
_GRAPH_SAFE: dict[str, tuple[str, ...]] = {
    "paged_decode": ("v2_triton",),
    "moe": ("triton",),
    "rms_norm": ("torch", "triton"),
    "qk_norm_rope": ("torch", "triton"),
    "gated_delta_rule": ("triton_recurrent", "triton_chunk", "recurrent", "chunk"),
    "causal_conv1d": ("torch", "triton"),
    "gdn_gating": ("torch", "triton"),
    "rms_norm_gated": ("torch", "triton"),
}


def graph_safe(op: str, variant: str) -> bool:
    """True when ``variant`` of ``op`` can run inside a captured CUDA graph (in a decode step)."""
    return variant in _GRAPH_SAFE.get(op, ())


def graph_safe_variants(op: str) -> tuple[str, ...]:
    return _GRAPH_SAFE.get(op, ())


# Whether the user asked for Triton's interpreter, read before any Triton module sets it for itself
# (they do on machines without CUDA, so that tests can run them).
INTERPRET_REQUESTED = os.environ.get("TRITON_INTERPRET") == "1"


def uses_triton(op: str, variant: str) -> bool:
    return variant in variants(op) and "triton" in _REGISTRY[op][variant].partition(":")[0]


class UnknownKernel(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


def variants(op: str) -> list[str]:
    """Variant names of ``op``, reference first."""
    if op not in _REGISTRY:
        raise UnknownKernel(f"unknown op {op!r}; known ops: {', '.join(OPS)}")
    return list(_REGISTRY[op])


def get(op: str, variant: str) -> Callable:
    """The callable for ``op``/``variant``; imports its module on first use."""
    names = variants(op)
    if variant not in names:
        raise UnknownKernel(f"unknown variant {variant!r} of op {op!r}; known: {', '.join(names)}")
    module, _, func = _REGISTRY[op][variant].partition(":")
    return getattr(importlib.import_module(module), func)
