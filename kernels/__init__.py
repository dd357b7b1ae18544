"""The project's attention, MoE and Gated DeltaNet kernels behind one lookup: ``variants(op)`` and ``get(op, variant)``.

Variants are registered by dotted path and imported on first use, so that asking for a torch
variant never imports Triton (which must see ``TRITON_INTERPRET`` before its first import).
"""
from __future__ import annotations

import importlib
import os
from typing import Callable

OPS = ("paged_decode", "prefix_prefill", "moe", "rms_norm", "qk_norm_rope", "gated_delta_rule")

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
}


# Variants that never wait on the device (no ``.item()``, ``.tolist()``, host-side maximum or
# data-dependent output size): a CUDA graph can capture them.
_GRAPH_SAFE: dict[str, set[str]] = {
    "paged_decode": {"v2_triton"},
    "moe": {"triton"},
    "rms_norm": {"torch", "triton"},
    "qk_norm_rope": {"torch", "triton"},
}


def graph_safe(op: str, variant: str) -> bool:
    """True when ``variant`` of ``op`` can run inside a captured CUDA graph."""
    return variant in _GRAPH_SAFE.get(op, ())


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
