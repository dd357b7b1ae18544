"""Time one kernel variant on Qwen3.6-35B-A3B shapes, usable as an orchestrator throughput probe.

    python -m kernels.bench --op paged_decode --variant v2_triton --batch 32 --context 4096
    python -m kernels.bench --op gated_delta_rule --variant triton_recurrent --batch 256   # decode step
    python -m kernels.bench --op gated_delta_rule --variant triton_chunk --batch 8 --new-tokens 1024
    python -m kernels.bench --op causal_conv1d --variant triton --batch 128          # decode step
    python -m kernels.bench --op rms_norm_gated --variant triton --tokens 128

Reports the median time after warm-up (``triton.testing.do_bench`` on CUDA, which also flushes L2
between runs), and the GB/s and TFLOP/s achieved against the bytes the op must move (each input
read once, the output written once) and the FLOPs it must do. Last stdout line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import kernels
from kernels import inputs

# Qwen3.6-35B-A3B
ATTENTION = dict(num_heads=16, num_kv_heads=2, head_size=256, block_size=16)
MOE = dict(hidden=2048, experts=256, intermediate=512, top_k=8)
GDN = dict(num_heads=32, num_k_heads=16, head_k=128, head_v=128)  # its Gated DeltaNet layers
GDN_CONV = dict(channels=8192, width=4)  # their convolution: q, k (16 x 128 each) and v (32 x 128)


def _size(t) -> int:
    return t.numel() * t.element_size()


def decode_workload(batch=32, context=4096, dtype=torch.bfloat16, device="cuda", **shape):
    shape = {**ATTENTION, **shape}
    args = inputs.paged_decode([context] * batch, dtype=dtype, device=device, **shape)
    elt = args["query"].element_size()
    kv = 2 * batch * context * shape["num_kv_heads"] * shape["head_size"] * elt
    nbytes = kv + 2 * _size(args["query"])
    flops = 4 * batch * context * shape["num_heads"] * shape["head_size"]
    return args, nbytes, flops


def prefill_workload(batch=1, new_tokens=8192, context=0, dtype=torch.bfloat16, device="cuda", **shape):
    shape = {**ATTENTION, **shape}
    args = inputs.prefix_prefill([(context, new_tokens)] * batch, dtype=dtype, device=device, **shape)
    elt = args["query"].element_size()
    ctx_kv = 2 * batch * context * shape["num_kv_heads"] * shape["head_size"] * elt
    nbytes = ctx_kv + 2 * _size(args["query"]) + _size(args["key"]) + _size(args["value"])
    pairs = batch * (new_tokens * context + new_tokens * (new_tokens + 1) // 2)  # causal: the lower triangle
    flops = 4 * pairs * shape["num_heads"] * shape["head_size"]
    return args, nbytes, flops


def moe_workload(tokens=256, dtype=torch.bfloat16, device="cuda", **shape):
    shape = {**MOE, **shape}
    args = inputs.moe(tokens, dtype=dtype, device=device, **shape)
    _, ids = torch.topk(args["router_logits"].float(), shape["top_k"], dim=-1)  # softmax keeps the order
    used = int(torch.unique(ids).numel())
    per_expert = _size(args["w13"][0]) + _size(args["w2"][0])
    nbytes = used * per_expert + 2 * _size(args["hidden_states"]) + _size(args["router_logits"])
    flops = 2 * tokens * shape["top_k"] * 3 * shape["intermediate"] * shape["hidden"]
    return args, nbytes, flops


def gdn_workload(batch=256, new_tokens=1, dtype=torch.bfloat16, device="cuda", narrow_state=False, **shape):
    """As the engine calls the op: ``new_tokens`` 1 is one decode step of ``batch`` sequences
    ([batch, 1]), more is a packed prefill; states in a slot pool, updated in place, float32 (or with
    ``narrow_state`` in ``dtype``, as ``mamba-ssm-cache-dtype: bfloat16`` keeps them). The bytes are the
    floor: q, k, v, g, beta read, o written, each state read and written once."""
    shape = {**GDN, **shape}
    args = inputs.gated_delta_rule([new_tokens] * batch, packed=new_tokens > 1, slots=True, dtype=dtype,
                                   device=device, narrow_state=narrow_state, **shape)
    tensors = ("q", "k", "v", "g", "beta")
    state = batch * shape["num_heads"] * shape["head_k"] * shape["head_v"] * args["initial_state"].element_size()
    nbytes = sum(_size(args[k]) for k in tensors) + _size(args["v"]) + 2 * state
    flops = 6 * batch * new_tokens * shape["num_heads"] * shape["head_k"] * shape["head_v"]  # the recurrence's
    return args, nbytes, flops


def conv_workload(batch=256, new_tokens=1, dtype=torch.bfloat16, device="cuda", **shape):
    """As the engine calls it: ``new_tokens`` 1 is one decode step of ``batch`` sequences, more a
    packed prefill; states in a slot pool. Bytes: x read, the output written, each state read and
    written once, the weights read."""
    shape = {**GDN_CONV, **shape}
    args = inputs.causal_conv1d([new_tokens] * batch, packed=new_tokens > 1, dtype=dtype, device=device, **shape)
    c, w, elt = shape["channels"], shape["width"], args["x"].element_size()
    nbytes = (2 * batch * new_tokens * c + 2 * batch * c * (w - 1) + c * w) * elt
    return args, nbytes, 2 * batch * new_tokens * c * w


def gating_workload(tokens=256, dtype=torch.bfloat16, device="cuda", num_heads=GDN["num_heads"]):
    """a and b read, g (float32) and beta written."""
    args = inputs.gdn_gating(tokens, num_heads, dtype=dtype, device=device)
    elt = args["a"].element_size()
    return args, tokens * num_heads * (3 * elt + 4), 8 * tokens * num_heads


def norm_gated_workload(tokens=256, dtype=torch.bfloat16, device="cuda", num_heads=GDN["num_heads"],
                        head_size=GDN["head_v"]):
    """x and the gate read, the output written."""
    args = inputs.rms_norm_gated(tokens, num_heads, head_size, dtype=dtype, device=device)
    n = tokens * num_heads * head_size
    return args, 3 * n * args["x"].element_size(), 8 * n


WORKLOADS = {"paged_decode": decode_workload, "prefix_prefill": prefill_workload, "moe": moe_workload,
             "gated_delta_rule": gdn_workload, "causal_conv1d": conv_workload, "gdn_gating": gating_workload,
             "rms_norm_gated": norm_gated_workload}


def median_ms(fn, device: str, warmup_ms: float = 50, rep_ms: float = 200) -> float:
    if device == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times, spent = [], 0.0
    while len(times) < 5 or (spent < rep_ms / 1e3 and len(times) < 100):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return statistics.median(times) * 1e3


def measure(op: str, variant: str, device: str = "cuda", dtype=torch.bfloat16, kernel_kwargs=None, **shape) -> dict:
    """Median time, GB/s and TFLOP/s of ``op``/``variant`` on one workload (``shape`` overrides its defaults)."""
    fn = kernels.get(op, variant)
    args, nbytes, flops = WORKLOADS[op](dtype=dtype, device=device, **shape)
    kw = kernel_kwargs or {}
    ms = median_ms(lambda: fn(**args, **kw), device)
    return dict(op=op, variant=variant, device=device, dtype=str(dtype).removeprefix("torch."), shape=shape,
                kernel_kwargs=kw, median_ms=ms, gbps=nbytes / ms / 1e6, tflops=flops / ms / 1e9,
                bytes=nbytes, flops=flops)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.splitlines()[0])
    p.add_argument("--op", required=True, choices=kernels.OPS)
    p.add_argument("--variant", required=True)
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--batch", type=int, help="decode and prefill: sequences")
    p.add_argument("--context", type=int, help="decode: tokens per sequence; prefill: cached tokens")
    p.add_argument("--new-tokens", type=int,
                   help="prefill: new tokens per sequence (gated_delta_rule, causal_conv1d: 1 = decode)")
    p.add_argument("--tokens", type=int, help="moe, gdn_gating, rms_norm_gated: tokens")
    p.add_argument("--small", action="store_true", help="small model dimensions (for CPU smoke runs)")
    p.add_argument("--block-m", type=int)
    p.add_argument("--block-n", type=int)
    p.add_argument("--num-warps", type=int)
    a = p.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype or ("bfloat16" if device == "cuda" else "float32"))
    try:
        kernels.get(a.op, a.variant)
    except (kernels.UnknownKernel, ImportError) as exc:
        print(json.dumps(dict(op=a.op, variant=a.variant, error=str(exc))))
        return 2
    names = {"paged_decode": ["batch", "context"], "prefix_prefill": ["batch", "context", "new_tokens"],
             "moe": ["tokens"], "gated_delta_rule": ["batch", "new_tokens"], "causal_conv1d": ["batch", "new_tokens"],
             "gdn_gating": ["tokens"], "rms_norm_gated": ["tokens"]}[a.op]
    shape = {n: getattr(a, n) for n in names if getattr(a, n) is not None}
    if a.small:
        shape.update({"moe": dict(hidden=256, experts=16, intermediate=128),
                      "gated_delta_rule": dict(num_heads=4, num_k_heads=2, head_k=32, head_v=32),
                      "causal_conv1d": dict(channels=64), "gdn_gating": dict(num_heads=4),
                      "rms_norm_gated": dict(num_heads=4, head_size=32)}.get(
                          a.op, dict(num_heads=4, num_kv_heads=2, head_size=64)))
    kw = {k: v for k, v in dict(block_m=a.block_m, block_n=a.block_n, num_warps=a.num_warps).items() if v}
    if kw and a.op != "prefix_prefill":
        p.error("--block-m/--block-n/--num-warps apply to prefix_prefill only")
    print(json.dumps(measure(a.op, a.variant, device, dtype, kw, **shape)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
