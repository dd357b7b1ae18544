"""Kernel selection: each kernel key of the serve config names a fallback chain of variants.

At start-up every variant in a chain is tried in order on a small random input shaped like the
model's, and the first whose output matches the float64 ``reference`` is used. This is how an
optimized kernel ships safely: where it fails (no GPU, no Triton, a bad build) the next one runs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

import kernels
from kernels import inputs
from kernels.check import outputs
from engine.config import KERNEL_KEYS, EngineConfig
from engine.model_config import ModelConfig

log = logging.getLogger("engine")

# relative error allowed against the reference, by the dtype the engine runs in
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


@dataclass
class Kernels:
    decode: Callable
    decode_long: Callable
    prefill: Callable
    moe: Callable
    rms_norm: Callable
    qk_norm_rope: Callable
    prefill_kwargs: dict[str, int]
    choice: dict[str, str] = field(default_factory=dict)  # serve-config key -> variant used


def _check_inputs(op: str, model: ModelConfig, block_size: int, dtype, device, seed: int) -> dict:
    geometry = dict(num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, head_size=model.head_size,
                    block_size=block_size, dtype=dtype, device=device, seed=seed)
    if op == "paged_decode":
        return inputs.paged_decode([1, block_size + 3, 600], **geometry)
    if op == "prefix_prefill":
        return inputs.prefix_prefill([(0, 5), (block_size + 3, 20), (40, 1)], **geometry)
    if op == "rms_norm":
        return inputs.rms_norm(12, hidden=model.hidden_size, dtype=dtype, device=device, seed=seed)
    if op == "qk_norm_rope":
        return inputs.qk_norm_rope(12, model.num_heads, model.num_kv_heads, model.head_size, model.rotary_dim,
                                   gated=model.attn_output_gate, theta=model.rope_theta, dtype=dtype, device=device,
                                   seed=seed)
    experts = min(model.num_experts, 16)
    return inputs.moe(12, hidden=model.hidden_size, experts=experts, intermediate=model.moe_intermediate_size,
                      top_k=min(model.top_k, experts), dtype=dtype, device=device, seed=seed)


def self_check(op: str, variant: str, args: dict, extra: dict) -> str | None:
    """None when ``variant`` matches the reference on ``args``, else why not."""
    device = next(v for v in args.values() if isinstance(v, torch.Tensor)).device
    if device.type != "cuda" and kernels.uses_triton(op, variant) and not kernels.INTERPRET_REQUESTED:
        # the interpreter would pass the check and then serve 10-100x slower than any torch variant
        return "Triton kernels need a CUDA device here (set TRITON_INTERPRET=1 to run them interpreted)"
    try:
        fn = kernels.get(op, variant)
        out = fn(**args, **extra)
        ref = kernels.get(op, "reference")(**args, **extra)
    except Exception as exc:  # any failure of an optional kernel just means: try the next one
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    out, ref = outputs(out), outputs(ref)
    if len(out) != len(ref):
        return f"returned {len(out)} outputs, expected {len(ref)}"
    for o, r in zip(out, ref):
        if o.shape != r.shape or o.dtype != r.dtype:
            return f"returned {tuple(o.shape)} {o.dtype}, expected {tuple(r.shape)} {r.dtype}"
        if not torch.isfinite(o).all():
            return "output holds NaN or infinity"
        err = float((o.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30))
        tol = TOLERANCE.get(r.dtype, 1e-4)
        if err > tol:
            return f"relative error {err:.2e} above {tol:.0e}"
    return None


def select_kernels(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Kernels:
    chosen: dict[str, Callable] = {}
    choice: dict[str, str] = {}
    for key, op in KERNEL_KEYS.items():
        extra = config.prefill_kwargs() if op == "prefix_prefill" else {}
        args = _check_inputs(op, config.hf, config.block_size, dtype, device, config.seed)
        failures = []
        for variant in config.chain(key):
            reason = self_check(op, variant, args, extra)
            if reason is None:
                chosen[key], choice[key] = kernels.get(op, variant), variant
                break
            failures.append(f"{variant} ({reason})")
            log.warning("%s: variant %s failed its self-check: %s", key, variant, reason)
        else:
            raise config.error(key, "no variant passed the start-up self-check: " + "; ".join(failures))
        log.info("%s: using %s", key, choice[key])
    return Kernels(decode=chosen["attention-decode"], decode_long=chosen["attention-decode-long"],
                   prefill=chosen["attention-prefill"], moe=chosen["moe-dispatch"], rms_norm=chosen["rms-norm"],
                   qk_norm_rope=chosen["qk-norm-rope"],
                   prefill_kwargs=config.prefill_kwargs(), choice=choice)
