"""Kernel selection: each kernel key of the serve config names a fallback chain of variants.

At start-up every variant in a chain is tried in order on a small random input shaped like the
model's, and the first whose output matches the float64 ``reference`` is used. This is how an
optimized kernel ships safely: where it fails (no GPU, no Triton, a bad build) the next one runs.
The Gated DeltaNet keys are checked (and used) only for a model that has such layers, in the way
the engine calls them: packed prefills and single-token decodes, states updated in place by slot.
A key may select several ops by one variant name (``gdn-fused``): the variant passes when all do.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

import kernels
from kernels import check, inputs
from engine.config import KERNEL_KEYS, EngineConfig, key_ops
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
    gdn_conv: Callable | None = None  # gdn-fused: causal_conv1d, gdn_gating, rms_norm_gated
    gdn_gating: Callable | None = None
    rms_norm_gated: Callable | None = None


GDN_KEYS = ("gdn-prefill", "gdn-decode", "gdn-fused")


def keys_for(model: ModelConfig) -> list[str]:
    """The kernel keys the model runs: the Gated DeltaNet ones only where it has such layers."""
    return [key for key in KERNEL_KEYS if key not in GDN_KEYS or model.is_hybrid]


def _check_inputs(key: str, op: str, model: ModelConfig, block_size: int, dtype, device, seed: int) -> list[dict]:
    """The inputs ``op`` of ``key`` is checked on at start-up, shaped as the engine calls it."""
    made = dict(dtype=dtype, device=device, seed=seed)
    if op == "gated_delta_rule":
        lens = [5, 70, 1] if key == "gdn-prefill" else [1, 1, 1]  # decode: [3 sequences, 1 token]
        return [inputs.gated_delta_rule(lens, num_heads=model.linear_num_value_heads,
                                        num_k_heads=model.linear_num_key_heads, head_k=model.linear_key_head_dim,
                                        head_v=model.linear_value_head_dim, slots=True, **made)]
    if op == "causal_conv1d":  # a decode step [3, 1], and packed prefills as short as one token
        conv = dict(channels=model.linear_conv_dim, width=model.linear_conv_kernel_dim, **made)
        return [inputs.causal_conv1d([1, 1, 1], **conv), inputs.causal_conv1d([5, 70, 1, 2], **conv)]
    if op == "gdn_gating":
        return [inputs.gdn_gating(12, model.linear_num_value_heads, **made)]
    if op == "rms_norm_gated":
        return [inputs.rms_norm_gated(12, model.linear_num_value_heads, model.linear_value_head_dim, **made)]
    geometry = dict(num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, head_size=model.head_size,
                    block_size=block_size, **made)
    if op == "paged_decode":
        return [inputs.paged_decode([1, block_size + 3, 600], **geometry)]
    if op == "prefix_prefill":
        return [inputs.prefix_prefill([(0, 5), (block_size + 3, 20), (40, 1)], **geometry)]
    if op == "rms_norm":
        return [inputs.rms_norm(12, hidden=model.hidden_size, **made)]
    if op == "qk_norm_rope":
        return [inputs.qk_norm_rope(12, model.num_heads, model.num_kv_heads, model.head_size, model.rotary_dim,
                                    gated=model.attn_output_gate, theta=model.rope_theta, **made)]
    experts = min(model.num_experts, 16)
    return [inputs.moe(12, hidden=model.hidden_size, experts=experts, intermediate=model.moe_intermediate_size,
                       top_k=min(model.top_k, experts), **made)]


def triton_runs(device: torch.device) -> bool:
    """Whether the engine runs Triton kernels here: on a GPU, or interpreted when asked for."""
    return device.type == "cuda" or kernels.INTERPRET_REQUESTED


def gdn_triton_runs(config: EngineConfig) -> tuple[bool, str]:
    """Whether a Triton variant of a Gated DeltaNet key would run for ``config`` here (the model has
    such layers and Triton runs on its device), and a line saying so: elsewhere the key falls back,
    and setting it changes nothing."""
    device = config.torch_device()
    hybrid, runs = config.hf.is_hybrid, triton_runs(device)
    return hybrid and runs, (f"model {config.model} has Gated DeltaNet layers: {hybrid}; "
                             f"Triton runs on {device}: {runs}")


def self_check(op: str, variant: str, args: dict, extra: dict) -> str | None:
    """None when ``variant`` matches the reference on ``args``, else why not."""
    device = next(v for v in args.values() if isinstance(v, torch.Tensor)).device
    if kernels.uses_triton(op, variant) and not triton_runs(device):
        # the interpreter would pass the check and then serve 10-100x slower than any torch variant
        return "Triton kernels need a CUDA device here (set TRITON_INTERPRET=1 to run them interpreted)"
    dtype = next(v for v in args.values() if isinstance(v, torch.Tensor)).dtype
    try:
        fn = functools.partial(kernels.get(op, variant), **extra)
        err = check.check_one(fn, functools.partial(kernels.get(op, "reference"), **extra), args, op)
    except Exception as exc:  # any failure of an optional kernel just means: try the next one
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    if err != err:
        return "output holds NaN or infinity"
    tol = TOLERANCE.get(dtype, 1e-4)
    if err > tol:
        return f"relative error {err:.2e} above {tol:.0e}"
    return None


def _key_check(key: str, variant: str, checks: list[tuple[str, dict]], extra: dict) -> str | None:
    """None when ``variant`` passes every check of ``key`` (op, inputs), else why not."""
    several = len(key_ops(key)) > 1
    for op, args in checks:
        reason = self_check(op, variant, args, extra)
        if reason is not None:
            return f"{op}: {reason}" if several else reason
    return None


def select_kernels(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Kernels:
    chosen: dict[tuple[str, str], Callable] = {}  # (key, op) -> the callable used
    choice: dict[str, str] = {}
    for key in keys_for(config.hf):
        extra = config.prefill_kwargs() if KERNEL_KEYS[key] == "prefix_prefill" else {}
        checks = [(op, args) for op in key_ops(key)
                  for args in _check_inputs(key, op, config.hf, config.block_size, dtype, device, config.seed)]
        failures = []
        for variant in config.chain(key):
            reason = _key_check(key, variant, checks, extra)
            if reason is None:
                chosen.update({(key, op): kernels.get(op, variant) for op in key_ops(key)})
                choice[key] = variant
                break
            failures.append(f"{variant} ({reason})")
            log.warning("%s: variant %s failed its self-check: %s", key, variant, reason)
        else:
            raise config.error(key, "no variant passed the start-up self-check: " + "; ".join(failures))
        log.info("%s: using %s", key, choice[key])

    def use(key: str, op: str | None = None) -> Callable | None:
        return chosen.get((key, op or KERNEL_KEYS[key]))

    return Kernels(decode=use("attention-decode"), decode_long=use("attention-decode-long"),
                   prefill=use("attention-prefill"), moe=use("moe-dispatch"), rms_norm=use("rms-norm"),
                   qk_norm_rope=use("qk-norm-rope"), prefill_kwargs=config.prefill_kwargs(), choice=choice,
                   gdn_prefill=use("gdn-prefill"), gdn_decode=use("gdn-decode"),
                   gdn_conv=use("gdn-fused", "causal_conv1d"), gdn_gating=use("gdn-fused", "gdn_gating"),
                   rms_norm_gated=use("gdn-fused", "rms_norm_gated"))
