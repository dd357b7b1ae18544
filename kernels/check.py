"""Correctness of one kernel variant against the float64 reference, usable as an orchestrator probe.

    python -m kernels.check --op paged_decode --variant v2_triton --device cuda --dtype bfloat16

Every call draws fresh random inputs over a shape list that holds the edges where kernels break
(partition boundaries, partial blocks, empty contexts, experts with no token, shared experts, GQA 4
and 8, head sizes 128 and 256, partial rotary; for the gated delta rule: packed sequences across
chunk edges, states updated in place by slot with the other slots untouched (float32 and, in a
16-bit check, 16-bit state pools), and a prefill continued by decode steps from its carried state;
for the Gated DeltaNet layer's convolution, a decode step and packed prefills with sequences shorter
than its state, by slot likewise; its gates past both tails of the softplus; its gated norm on a
strided gate). The last stdout line is one JSON object: passed, worst error, where it occurred.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

import torch

import kernels
from kernels import gdn_ops, inputs

# ‖out − ref‖ / ‖ref‖ allowed per input dtype (float32: full-precision dots, no tf32)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

GQA8 = dict(num_heads=16, num_kv_heads=2, head_size=256)
GQA4 = dict(num_heads=8, num_kv_heads=2, head_size=128)

FULL = {
    "paged_decode": [
        dict(seq_lens=[511, 512, 513, 8192, 8193], **GQA8),
        dict(seq_lens=[1, 15, 17, 100, 1000, 4097], **GQA4),
        dict(seq_lens=[33, 700, 1], block_size=32, **GQA4),
        dict(seq_lens=[3000], num_heads=4, num_kv_heads=4, head_size=128),
    ],
    "prefix_prefill": [
        dict(seqs=[(0, 100), (0, 1), (17, 50)], **GQA8),
        dict(seqs=[(513, 64), (1000, 3), (16, 129)], **GQA4),
        dict(seqs=[(8192, 16), (8193, 40)], **GQA8),
        dict(seqs=[(0, 511), (31, 600)], **GQA4),
    ],
    "gated_delta_rule": [
        dict(seq_lens=[100, 1, 64, 65, 300], num_heads=8, num_k_heads=4, head_k=64, head_v=64),
        dict(seq_lens=[128, 128], num_heads=4, head_k=128, head_v=128, l2norm=False, initial_state=False),
        dict(seq_lens=[1] * 6, num_heads=32, num_k_heads=16, head_k=128, head_v=128, slots=True),  # Qwen3.6 decode
        dict(seq_lens=[200, 3, 129], num_heads=32, num_k_heads=16, head_k=128, head_v=128, slots=True),
        # the same in a state pool of the inputs' dtype (16-bit in a bf16 or fp16 check)
        dict(seq_lens=[1] * 6, num_heads=32, num_k_heads=16, head_k=128, head_v=128, slots=True, narrow_state=True),
        dict(seq_lens=[200, 3, 129], num_heads=32, num_k_heads=16, head_k=128, head_v=128, slots=True,
             narrow_state=True),
        dict(seq_lens=[70, 70], num_heads=4, num_k_heads=2, head_k=32, head_v=64, split=64),
    ],
    "moe": [
        dict(tokens=1, hidden=256, experts=64, intermediate=128, top_k=8),
        dict(tokens=7, hidden=256, experts=64, intermediate=128, top_k=8, unused_experts=16),
        dict(tokens=300, hidden=512, experts=32, intermediate=256, top_k=4, unused_experts=3),
        dict(tokens=64, hidden=128, experts=16, intermediate=64, top_k=2, unused_experts=5),
        dict(tokens=9, hidden=128, experts=16, intermediate=64, top_k=4, shared_experts=1),
    ],
    "rms_norm": [
        dict(tokens=1, hidden=2048, residual=True),
        dict(tokens=300, hidden=2048, residual=False),
        dict(tokens=64, hidden=2048, residual=True),
        dict(tokens=33, hidden=1000, residual=True),
    ],
    "qk_norm_rope": [
        dict(tokens=1, num_heads=16, num_kv_heads=2, head_size=256, rotary_dim=64),
        dict(tokens=300, num_heads=16, num_kv_heads=2, head_size=256, rotary_dim=64),
        dict(tokens=17, num_heads=8, num_kv_heads=2, head_size=128, rotary_dim=128, gated=False),
        dict(tokens=9, num_heads=4, num_kv_heads=4, head_size=96, rotary_dim=24),
    ],
    "causal_conv1d": [  # Qwen3.6's 8,192 channels: a decode step, then packed prefills (1 and 2 tokens: shorter
        dict(seq_lens=[1] * 6, channels=8192),  # than the state, so the new state keeps some of the old)
        dict(seq_lens=[100, 1, 2, 3, 64, 17], channels=8192),
        dict(seq_lens=[33, 33], channels=1000),
        dict(seq_lens=[5, 0, 40], channels=300, width=3),
    ],
    "gdn_gating": [
        dict(tokens=1, num_heads=32),
        dict(tokens=256, num_heads=32),
        dict(tokens=1000, num_heads=32),
        dict(tokens=9, num_heads=12),
    ],
    "rms_norm_gated": [
        dict(tokens=1, num_heads=32, head_size=128),
        dict(tokens=256, num_heads=32, head_size=128),
        dict(tokens=300, num_heads=32, head_size=128),
        dict(tokens=7, num_heads=3, head_size=100),
    ],
}
# Qwen3.6-35B-A3B's expert shapes are too large for a float64 CPU reference; checked on CUDA only.
CUDA_ONLY = {"moe": [dict(tokens=64, hidden=2048, experts=256, intermediate=512, top_k=8, unused_experts=32),
                     dict(tokens=300, hidden=2048, experts=256, intermediate=512, top_k=8, shared_experts=1)]}

# Small enough for the Triton interpreter, still crossing blocks, partitions and GQA groups.
SMALL = {
    "paged_decode": [
        dict(seq_lens=[1, 17, 40], num_heads=4, num_kv_heads=2, head_size=32),
        dict(seq_lens=[513, 5], num_heads=8, num_kv_heads=1, head_size=16, block_size=8),
    ],
    "prefix_prefill": [
        dict(seqs=[(0, 9), (17, 20), (5, 1)], num_heads=4, num_kv_heads=2, head_size=32),
        dict(seqs=[(40, 33)], num_heads=8, num_kv_heads=1, head_size=16, block_size=8),
    ],
    "gated_delta_rule": [
        dict(seq_lens=[20, 1, 70], num_heads=4, num_k_heads=2, head_k=16, head_v=32),
        dict(seq_lens=[1] * 3, num_heads=4, num_k_heads=2, head_k=32, head_v=32, slots=True),
        dict(seq_lens=[1] * 3, num_heads=4, num_k_heads=2, head_k=32, head_v=32, slots=True, narrow_state=True),
        dict(seq_lens=[9, 1, 20], num_heads=4, num_k_heads=2, head_k=16, head_v=32, slots=True, narrow_state=True),
        dict(seq_lens=[17, 17], num_heads=2, head_k=16, head_v=16, split=14),
    ],
    "moe": [
        dict(tokens=5, hidden=32, experts=8, intermediate=16, top_k=2, unused_experts=3),
        dict(tokens=33, hidden=64, experts=6, intermediate=32, top_k=3),
        dict(tokens=6, hidden=32, experts=8, intermediate=16, top_k=2, shared_experts=1, unused_experts=2),
    ],
    "rms_norm": [
        dict(tokens=5, hidden=64, residual=True),
        dict(tokens=3, hidden=48, residual=False),
    ],
    "qk_norm_rope": [
        dict(tokens=5, num_heads=4, num_kv_heads=2, head_size=32, rotary_dim=8),
        dict(tokens=3, num_heads=2, num_kv_heads=1, head_size=16, rotary_dim=16, gated=False),
    ],
    "causal_conv1d": [
        dict(seq_lens=[1] * 3, channels=48),
        dict(seq_lens=[20, 1, 2, 0, 5], channels=40),
        dict(seq_lens=[6, 6], channels=24, width=3),
    ],
    "gdn_gating": [
        dict(tokens=3, num_heads=4),
        dict(tokens=20, num_heads=6),
    ],
    "rms_norm_gated": [
        dict(tokens=3, num_heads=4, head_size=16),
        dict(tokens=5, num_heads=3, head_size=24),
    ],
}


def shape_list(op: str, device: str, small: bool) -> list[dict]:
    if small:
        return SMALL[op]
    return FULL[op] + (CUDA_ONLY.get(op, []) if device == "cuda" else [])


def make_inputs(op: str, shape: dict, dtype, device) -> dict:
    return getattr(inputs, op)(**shape, dtype=dtype, device=device)


def as_float64(args: dict) -> dict:
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in args.items()}


def _poison(device: str, numel: int) -> None:
    """Leave NaN in the memory the caching allocator hands out next, so an unwritten output element shows."""
    if device == "cuda":
        torch.empty(numel * 2, dtype=torch.float32, device=device).fill_(float("nan"))


def outputs(out) -> tuple:
    """An op's results as a tuple (rms_norm with a residual, qk_norm_rope and the gated delta rule give two)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def rel_error(out, ref) -> float:
    """Worst ‖out − ref‖ / ‖ref‖ over the results; NaN when any is non-finite."""
    errors = [_rel_error(o, r) for o, r in zip(outputs(out), outputs(ref))]
    return float("nan") if any(e != e for e in errors) else max(errors)


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: unlike ``torch.equal``, NaN (the inputs' blank cache slots) equals itself."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                              b.contiguous().view(-1).view(torch.uint8))


def result_dtypes(op: str | None, dtype) -> tuple:
    """The dtypes the contract gives an op's results for inputs of ``dtype``, by position (results
    past the tuple are not checked): the first in the inputs' dtype, but ``gdn_gating``'s decays
    are float32 whatever the activations' dtype."""
    if op == "gdn_gating":
        return gdn_ops.decay_dtype(dtype), dtype
    return (dtype,)


def _compare(out, ref_out, dtypes: tuple) -> float:
    """Worst relative error over the results; raises when one is missing, misshapen or mistyped."""
    outs, refs = outputs(out), outputs(ref_out)
    if len(outs) != len(refs) or any(o is not None and o.dtype != d for o, d in zip(outs, dtypes)):
        raise AssertionError(f"results {_describe(out)} do not match {_describe(ref_out)} (in {_names(dtypes)})")
    worst = 0.0
    for o, r in zip(outs, refs):
        if (o is None) != (r is None) or (o is not None and o.shape != r.shape):
            raise AssertionError(f"results {_describe(out)} do not match {_describe(ref_out)}")
        if o is not None:
            err = rel_error(o, r)
            worst = err if not err <= worst else worst  # NaN sticks
    return worst


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _describe(out) -> str:
    return ", ".join("None" if o is None else f"{tuple(o.shape)} {o.dtype}" for o in outputs(out))


def _numel(out) -> int:
    return sum(o.numel() for o in outputs(out) if o is not None)


def _tensors(args: dict) -> dict:
    return {k: v for k, v in args.items() if torch.is_tensor(v)}


def _dtype(args: dict):
    """The inputs' dtype: the first floating-point tensor's."""
    return next(v.dtype for v in args.values() if torch.is_tensor(v) and v.is_floating_point())


# the argument that holds the pool of states an op with ``state_slots`` updates in place
POOLS = ("initial_state", "conv_state")


def check_one(fn: Callable, reference: Callable, args: dict, op: str | None = None) -> float:
    """Relative error of ``fn`` on ``args``; NaN when an output is non-finite. Raises if an input changed
    or a result has another dtype than the contract of ``op`` gives it (``result_dtypes``).

    A call with ``state_slots`` (the gated delta rule, the convolution) updates its state pool in
    place: there the pool's slots are compared with the reference's, and every other slot must keep
    its bytes."""
    if args.get("state_slots") is not None:
        return check_slots(fn, reference, args, op)
    before = {k: v.clone() for k, v in _tensors(args).items()}
    ref_out = reference(**as_float64(args))
    _poison(outputs(ref_out)[0].device.type, _numel(ref_out))
    out = fn(**args)
    for k, v in before.items():
        if not _same_bytes(v, args[k]):
            raise AssertionError(f"input {k!r} was modified")
    err = _compare(out, ref_out, result_dtypes(op, _dtype(args)))
    inputs_at = {v.data_ptr() for v in before.values()} | {v.data_ptr() for v in _tensors(args).values()}
    if any(o is not None and o.data_ptr() in inputs_at for o in outputs(out)):
        raise AssertionError("output aliases an input")
    return err


def check_slots(fn: Callable, reference: Callable, args: dict, op: str | None = None) -> float:
    name = next(k for k in POOLS if args.get(k) is not None)
    pool, slots = args[name], args["state_slots"]
    before = {k: v.clone() for k, v in _tensors(args).items()}
    ref_args = as_float64(args)
    ref_args[name] = pool.double().clone()
    ref_out = reference(**ref_args)
    _poison(pool.device.type, _numel(ref_out))
    out = fn(**args)
    for k, v in before.items():
        if k != name and not _same_bytes(v, args[k]):
            raise AssertionError(f"input {k!r} was modified")
    rest = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    rest[slots.long()] = False
    if not _same_bytes(pool[rest], before[name][rest]):
        raise AssertionError("states outside state_slots were modified")
    err = _compare(out, ref_out, result_dtypes(op, _dtype(args)))
    state_err = rel_error(pool[slots.long()], ref_args[name][slots.long()])
    return err if not err <= state_err else state_err


def check_split(fn: Callable, reference: Callable, args: dict, split: int) -> float:
    """A prefill of ``split`` tokens per sequence, then its final state carried into one decode step
    per remaining token (states in a slot pool), against one reference call over all tokens."""
    ref_o, ref_s = reference(**as_float64(args))
    seq = ("q", "k", "v", "g", "beta")
    first = {**args, **{k: args[k][:, :split] for k in seq}, "output_final_state": True}
    o1, s1 = fn(**first)
    n = args["q"].shape[0]
    pool = torch.full((n + 2, *s1.shape[1:]), float("nan"), dtype=s1.dtype, device=s1.device)
    slots = torch.randperm(n + 2, device=s1.device)[:n]
    pool[slots] = s1
    outs = [o1]
    for t in range(split, args["q"].shape[1]):
        step = {**args, **{k: args[k][:, t:t + 1] for k in seq}, "initial_state": pool, "state_slots": slots,
                "output_final_state": False}
        outs.append(fn(**step)[0])
    err = _compare(torch.cat(outs, 1), ref_o, (args["q"].dtype,))
    state_err = rel_error(pool[slots], ref_s)
    return err if not err <= state_err else state_err


def check_shape(op: str, fn: Callable, reference: Callable, shape: dict, dtype, device) -> float:
    shape = dict(shape)
    split = shape.pop("split", None)
    args = make_inputs(op, shape, dtype, device)
    return check_one(fn, reference, args, op) if split is None else check_split(fn, reference, args, split)


def run(op: str, variant: str, device: str = "cpu", dtype=torch.float32, small: bool = False, seed=None) -> dict:
    fn = kernels.get(op, variant)
    reference = kernels.get(op, "reference")
    tol = TOLERANCE[dtype]
    if seed is not None:
        torch.manual_seed(seed)
    worst, where, failure = 0.0, None, None
    for shape in shape_list(op, device, small):
        try:
            err = check_shape(op, fn, reference, shape, dtype, device)
        except Exception as exc:  # a crash is a failed check, reported with its shape
            failure, where, worst = f"{type(exc).__name__}: {exc}", shape, float("nan")
            break
        if not err <= worst:  # NaN propagates as worst
            worst, where = err, shape
        if not err <= tol:
            break
    passed = failure is None and worst <= tol
    result = dict(op=op, variant=variant, device=device, dtype=str(dtype).removeprefix("torch."), passed=passed,
                  worst_error=None if worst != worst else worst, tolerance=tol, worst_shape=where)
    if failure:
        result["error"] = failure
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.check", description=__doc__.splitlines()[0])
    p.add_argument("--op", required=True, choices=kernels.OPS)
    p.add_argument("--variant", required=True)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=list(DTYPES), help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--small", action="store_true", help="the small shape list (for the Triton interpreter)")
    p.add_argument("--seed", type=int)
    a = p.parse_args(argv)
    try:
        kernels.get(a.op, a.variant)
    except (kernels.UnknownKernel, ImportError) as exc:
        print(json.dumps(dict(op=a.op, variant=a.variant, passed=False, error=str(exc))))
        return 2
    if a.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps(dict(op=a.op, variant=a.variant, passed=False, error="--device cuda: no CUDA device")))
        return 2
    dtype = DTYPES[a.dtype or ("bfloat16" if a.device == "cuda" else "float32")]
    result = run(a.op, a.variant, a.device, dtype, a.small, a.seed)
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
