"""Kernel selection: each kernel key of the serve config names a fallback chain of variants.

At start-up every variant in a chain is tried in order on a small random input shaped like the
model's, and the first whose output matches the float64 ``reference`` is used. This is how an
optimized kernel ships safely: where it fails (no GPU, no Triton, a bad build) the next one runs.
The Gated DeltaNet keys are checked (and used) only for a model that has such layers, in the way
the engine calls them: packed prefills and single-token decodes, states updated in place by slot.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

import kernels
from kernels import check, inputs
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
    gdn_prefill: Callable | None = None  # hybrid models only
    gdn_decode: Callable | None = None


GDN_KEYS = ("gdn-prefill", "gdn-decode")


def keys_for(model: ModelConfig) -> list[str]:
    """The kernel keys the model runs: the Gated DeltaNet ones only where it has such layers."""
    return [key for key in KERNEL_KEYS if key not in GDN_KEYS or model.is_hybrid]


def _check_inputs(key: str, model: ModelConfig, block_size: int, dtype, device, seed: int) -> dict:
    op = KERNEL_KEYS[key]
    if op == "gated_delta_rule":
        lens = [5, 70, 1] if key == "gdn-prefill" else [1, 1, 1]  # decode: [3 sequences, 1 token]
        return inputs.gated_delta_rule(lens, num_heads=model.linear_num_value_heads,
                                       num_k_heads=model.linear_num_key_heads, head_k=model.linear_key_head_dim,
                                       head_v=model.linear_value_head_dim, slots=True, dtype=dtype, device=device,
                                       seed=seed)
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


def triton_runs(device: torch.device) -> bool:
    """Whether the engine runs Triton kernels here: on a GPU, or interpreted when asked for."""
    return device.type == "cuda" or kernels.INTERPRET_REQUESTED


def self_check(op: str, variant: str, args: dict, extra: dict) -> str | None:
    """None when ``variant`` matches the reference on ``args``, else why not."""
    device = next(v for v in args.values() if isinstance(v, torch.Tensor)).device
    if kernels.uses_triton(op, variant) and not triton_runs(device):
        # the interpreter would pass the check and then serve 10-100x slower than any torch variant
        return "Triton kernels need a CUDA device here (set TRITON_INTERPRET=1 to run them interpreted)"
    dtype = next(v for v in args.values() if isinstance(v, torch.Tensor)).dtype
    try:
        fn = functools.partial(kernels.get(op, variant), **extra)
        err = check.check_one(fn, functools.partial(kernels.get(op, "reference"), **extra), args)
    except Exception as exc:  # any failure of an optional kernel just means: try the next one
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    if err != err:
        return "output holds NaN or infinity"
    tol = TOLERANCE.get(dtype, 1e-4)
    if err > tol:
        return f"relative error {err:.2e} above {tol:.0e}"
    return None


def select_kernels(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Kernels:
    chosen: dict[str, Callable] = {}
    choice: dict[str, str] = {}
    for key in keys_for(config.hf):
        op = KERNEL_KEYS[key]
        extra = config.prefill_kwargs() if op == "prefix_prefill" else {}
        args = _check_inputs(key, config.hf, config.block_size, dtype, device, config.seed)
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
                   qk_norm_rope=chosen["qk-norm-rope"], prefill_kwargs=config.prefill_kwargs(), choice=choice,
                   gdn_prefill=chosen.get("gdn-prefill"), gdn_decode=chosen.get("gdn-decode"))
