"""The Gated DeltaNet kernels on one GPU: correct first, then timed against their memory floors.

    python -m kernels.gdn_report [--quick] [--out report.md] [--json gdn.json]
    python -m kernels.gdn_report --device cpu --small --quick   # a smoke run of this script (interpreter)

1. Correctness in bfloat16 of every variant of ``gated_delta_rule`` with ``kernels.check`` (fresh
   random inputs, outputs poisoned with NaN, states updated in place by slot with the other slots
   untouched, a prefill continued by decode steps), plus the engine's own shapes: a decode step of
   256 sequences and a packed prefill, Qwen3.6-35B-A3B's 32 value / 16 key heads of 128.
2. The card's copy bandwidth (read + write), which sets each floor.
3. Decode: one step of ``batch`` sequences as the engine runs it (``[batch, 1]``, states in a slot
   pool, updated in place: float32, and in a 16-bit run also 16-bit as ``mamba-ssm-cache-dtype: bfloat16``
   keeps them). Its floor is the state bytes read and written (32 x 128 x 128 x 4 bytes each way per
   sequence and layer in float32) plus q, k, v, g, beta and o.
4. Prefill: packed sequences; the floor is the same bytes (inputs, output, states once).
5. Where a chunked prefill spends its GPU time, kernel by kernel (torch.profiler).
6. Launch parameters of the Triton kernels timed, best first (``triton_recurrent``: value block and warps at
   batch 128 and 256, with the float32 state and, in a 16-bit run, the 16-bit one; ``triton_chunk``: chunk, value
   block, warps and stages of its scan, warps of its prepare kernel; "default" is what the op chooses).

Each table prints as soon as it is done; the last stdout line is one JSON object, and with ``$OUT``
set every measurement goes to ``$OUT/gdn_report.json`` too.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

import kernels
from kernels import bench, check
from kernels.h200_report import Report

OP = "gated_delta_rule"
SLOW_ON_LONG = {"recurrent"}  # a Python loop over tokens: not timed on prefills of over 1,024 tokens


class Setup:
    """Device, dimensions and sizes of one run: Qwen3.6-35B-A3B on a GPU, or small for a smoke run."""

    def __init__(self, device: str, small: bool, quick: bool):
        self.device, self.small, self.quick = device, small, quick
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.dims = dict(num_heads=4, num_k_heads=2, head_k=32, head_v=32) if small else bench.GDN
        self.decode_batches = [4] if small else [256] if quick else [1, 32, 128, 256]
        self.tuning_batches = [4] if small else [256] if quick else [128, 256]
        self.prefills = [(2, 40)] if small else [(1, 8192)] if quick else [(1, 8192), (8, 1024), (32, 1000)]
        self.tuning_prefill = (2, 40) if small else (8, 1024)

    def workload(self, batch: int, tokens: int, narrow_state: bool = False):
        return bench.gdn_workload(batch=batch, new_tokens=tokens, dtype=self.dtype, device=self.device,
                                  narrow_state=narrow_state, **self.dims)

    def time(self, fn) -> float | None:
        """Median ms, or None when the variant fails here (the reason is printed)."""
        try:
            return bench.median_ms(fn, self.device, warmup_ms=25, rep_ms=100)
        except Exception as exc:  # out of memory, a compile failure: report and go on
            print(f"  skipped: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr, flush=True)
            if self.device == "cuda":
                torch.cuda.empty_cache()
            return None


def copy_gbps(device: str) -> float:
    src = torch.randn(2**30 if device == "cuda" else 2**24, device=device, dtype=torch.float32)  # 4 GiB on a GPU
    dst = torch.empty_like(src)
    ms = bench.median_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 4 / ms / 1e6


def _fla():
    """flash-linear-attention's chunked kernel, when installed, as a point of comparison (packed
    sequences, no slots: the states are gathered and scattered around it)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or it does not import here
        return None

    def run(q, k, v, g, beta, initial_state, state_slots, use_qk_l2norm_in_kernel, cu_seqlens=None, **_):
        slots = state_slots.long()
        group = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
        o, final = chunk_gated_delta_rule(q, k, v, g.float(), beta, initial_state=initial_state[slots],
                                          output_final_state=True, cu_seqlens=None if cu_seqlens is None
                                          else cu_seqlens.long(), use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        initial_state.index_copy_(0, slots, final.to(initial_state.dtype))
        return o
    return run


def correctness(rep: Report, setup: Setup, variants: list[str]) -> dict[str, bool]:
    ref = kernels.get(OP, "reference")
    engine_shapes = [dict(seq_lens=[1] * 256, **bench.GDN, slots=True),
                     dict(seq_lens=[700, 1, 64, 333], **bench.GDN, slots=True)]
    rows, passed = [], {}
    tol = check.TOLERANCE[setup.dtype]
    for variant in variants:
        torch.manual_seed(0)
        result = check.run(OP, variant, setup.device, setup.dtype, small=setup.small)
        worst, where = result["worst_error"], result["worst_shape"]
        ok = result["passed"]
        if ok and not setup.quick and not setup.small:
            for shape in engine_shapes:
                err = check.check_shape(OP, kernels.get(OP, variant), ref, shape, setup.dtype, setup.device)
                ok = ok and err <= tol
                if not err <= (worst or 0.0):
                    worst, where = err, {k: v for k, v in shape.items() if k != "seq_lens"} | {
                        "seq_lens": shape["seq_lens"][:4]}
        passed[variant] = ok
        rows.append([variant, "pass" if ok else "FAIL", worst, json.dumps(where)[:80], result.get("error", "")])
        rep.rows.append(dict(table="correctness", variant=variant, passed=ok, worst_error=worst))
    rep.table(f"Correctness, {str(setup.dtype).removeprefix('torch.')} (relative error vs the float64 "
              f"reference; tolerance {tol:g})",
              ["variant", "result", "worst error", "where", "error"], rows)
    return passed


def decode_table(rep: Report, setup: Setup, gbps: float, variants: list[str]) -> None:
    rows = []
    widths = (False, True) if setup.dtype.itemsize < 4 else (False,)
    for batch in setup.decode_batches:
        for narrow in widths:
            args, nbytes, _ = setup.workload(batch, 1, narrow)
            states = str(args["initial_state"].dtype).removeprefix("torch.")
            floor_ms = nbytes / gbps / 1e6
            row = [batch, states, nbytes / 2**20, floor_ms]
            for v in variants:
                fn = kernels.get(OP, v)
                ms = setup.time(lambda: fn(**args))
                rep.rows.append(dict(table="decode", batch=batch, states=states, variant=v, ms=ms, floor_ms=floor_ms))
                row += [ms, f"{floor_ms / ms:.0%}" if ms else "n/a"]
            rows.append(row)
    rep.table(f"Decode step of one layer, {str(setup.dtype).removeprefix('torch.')} inputs (floor: bytes at "
              f"{gbps:.0f} GB/s copy; % = floor / time); x 30 layers per token step",
              ["batch", "states", "MiB moved", "floor ms"]
              + [h for v in variants for h in (f"{v} ms", f"{v} % floor")], rows)


def prefill_table(rep: Report, setup: Setup, gbps: float, variants: list[str]) -> None:
    fla = _fla() if setup.device == "cuda" else None
    rows = []
    for seqs, tokens in setup.prefills:
        args, nbytes, _ = setup.workload(seqs, tokens)
        floor_ms = nbytes / gbps / 1e6
        cands = [(v, functools.partial(kernels.get(OP, v), **args)) for v in variants
                 if v not in SLOW_ON_LONG or seqs * tokens <= 1024]
        if fla is not None:
            cands.append(("fla chunk (+ state gather/scatter)", functools.partial(fla, **args)))
        for name, fn in cands:
            ms = setup.time(fn)
            rep.rows.append(dict(table="prefill", seqs=seqs, tokens=tokens, variant=name, ms=ms, floor_ms=floor_ms))
            rows.append([seqs, tokens, name, ms, seqs * tokens / ms / 1e3 if ms else None,
                         f"{floor_ms / ms:.0%}" if ms else "n/a"])
    rep.table(f"Prefill of one layer, packed sequences (floor: bytes at {gbps:.0f} GB/s; "
              f"{'fla: installed' if fla else 'fla (flash-linear-attention) not installed'})",
              ["sequences", "tokens each", "variant", "ms", "M tokens/s", "% floor"], rows)


CHUNK_CONFIGS = [dict(chunk_size=c, block_v=b, num_warps=w, num_stages=st, prepare_warps=pw)
                 for c, b, w, st, pw in [(64, 16, 4, 2, 4), (64, 32, 4, 2, 4), (64, 32, 8, 2, 4), (64, 16, 4, 1, 4),
                                         (64, 64, 8, 2, 4), (32, 16, 4, 2, 4), (32, 32, 4, 2, 4), (64, 16, 4, 2, 8),
                                         (64, 16, 4, 2, 2)]]


def recurrent_rows(setup: Setup, gbps: float, quick: bool) -> list[list]:
    """The recurrent kernel's value block and warps at each tuning batch, with the state as the model declares it
    (float32) and, in a 16-bit run, 16-bit (mamba-ssm-cache-dtype): half the bytes, so the tile that streams best
    differs. "(default)" marks what a call without them gets (``gdn_triton.recurrent_launch``)."""
    from kernels import gdn_triton  # Triton: only where its variants run
    rec, rows = kernels.get(OP, "triton_recurrent"), []
    for narrow in (False, True) if setup.dtype != torch.float32 else (False,):
        for batch in setup.tuning_batches:
            args, nbytes, _ = setup.workload(batch, 1, narrow_state=narrow)
            bv, w = gdn_triton.recurrent_launch(args["initial_state"].dtype)
            default = (min(bv, setup.dims["head_v"]), w)
            kernel = f"triton_recurrent decode {batch}, {'16-bit' if narrow else 'float32'} state"
            for block_v in [32] if quick else [16, 32, 64, 128]:
                for warps in [4] if quick else [1, 2, 4, 8]:
                    ms = setup.time(lambda: rec(**args, block_v=block_v, num_warps=warps))
                    rows.append([kernel, f"block_v {block_v}, warps {warps}"
                                 + (" (default)" if (block_v, warps) == default else ""), ms,
                                 f"{nbytes / gbps / 1e6 / ms:.0%}" if ms else "n/a"])
    return rows


def chunk_rows(setup: Setup, gbps: float, quick: bool) -> list[list]:
    """The chunked prefill's chunk, value block, warps and stages ("default": ``chunk_configs``' choice)."""
    chunk, rows = kernels.get(OP, "triton_chunk"), []
    for seqs, tokens in [setup.tuning_prefill] + ([] if quick else [(1, 8192)]):
        args, nbytes, _ = setup.workload(seqs, tokens)
        for cfg in [{}] + (CHUNK_CONFIGS[:2] if quick else CHUNK_CONFIGS):
            ms = setup.time(lambda: chunk(**args, **cfg))
            label = "default" if not cfg else "chunk {chunk_size}, block_v {block_v}, warps {num_warps}, " \
                "stages {num_stages}, prepare warps {prepare_warps}".format(**cfg)
            rows.append([f"triton_chunk prefill {seqs} x {tokens}", label, ms,
                         f"{nbytes / gbps / 1e6 / ms:.0%}" if ms else "n/a"])
    return rows


def tuning(rep: Report, setup: Setup, gbps: float, timed: list[str]) -> None:
    """Launch parameters of the Triton variants that passed, each kernel's rows best first."""
    quick = setup.quick or setup.small
    rows = ((recurrent_rows(setup, gbps, quick) if "triton_recurrent" in timed else [])
            + (chunk_rows(setup, gbps, quick) if "triton_chunk" in timed else []))
    rows.sort(key=lambda r: (r[0], r[2] if r[2] is not None else float("inf")))
    for r in rows:
        rep.rows.append(dict(table="tuning", kernel=r[0], config=r[1], ms=r[2]))
    rep.table("Triton launch parameters (best first per kernel)", ["kernel", "parameters", "ms", "% floor"], rows)


def breakdown(rep: Report, setup: Setup) -> None:
    """GPU time of each kernel one chunked prefill launches (torch.profiler), so that the slower of
    the parallel prepare and the sequential scan shows."""
    from torch.profiler import ProfilerActivity, profile
    chunk = kernels.get(OP, "triton_chunk")
    rows = []
    for seqs, tokens in setup.prefills:
        args, _, _ = setup.workload(seqs, tokens)
        chunk(**args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                chunk(**args)
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                ms = e.device_time_total / 1e3 / 5
                rows.append([seqs, tokens, e.key[:60], ms])
                rep.rows.append(dict(table="breakdown", seqs=seqs, tokens=tokens, kernel=e.key, ms=ms))
    rep.table("triton_chunk prefill: GPU time per kernel (ms per call)", ["sequences", "tokens each", "kernel", "ms"],
              sorted(rows, key=lambda r: (r[0], r[1], -r[3])))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.gdn_report", description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also append the Markdown here")
    p.add_argument("--json", help="write every measurement here (default: $OUT/gdn_report.json when $OUT is set)")
    p.add_argument("--quick", action="store_true", help="one shape per table, fewer launch parameters")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="small dimensions (a smoke run on the CPU)")
    p.add_argument("--variants", help="comma-separated (default: every variant but the reference)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gdn_report needs a CUDA device (or --device cpu --small for a smoke run)", file=sys.stderr)
        return 2
    variants = a.variants.split(",") if a.variants else kernels.variants(OP)[1:]
    unknown = set(variants) - set(kernels.variants(OP))
    if unknown:
        p.error(f"unknown variant(s) {', '.join(sorted(unknown))}; known: {', '.join(kernels.variants(OP))}")
    setup = Setup(a.device, a.small, a.quick)
    rep = Report(a.out)
    if a.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        rep.emit(f"## {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    passed = correctness(rep, setup, variants)
    gbps = copy_gbps(a.device)
    rep.emit(f"\nMeasured copy bandwidth: {gbps:.0f} GB/s (read + write)")
    timed = [v for v, ok in passed.items() if ok]
    decode_table(rep, setup, gbps, timed)
    prefill_table(rep, setup, gbps, timed)
    if "triton_chunk" in timed and a.device == "cuda":
        breakdown(rep, setup)
    if {"triton_recurrent", "triton_chunk"} & set(timed):
        tuning(rep, setup, gbps, timed)
    path = a.json or (os.path.join(os.environ["OUT"], "gdn_report.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(dict(copy_gbps=gbps, passed=passed, rows=rep.rows), f, indent=1)
    print(json.dumps(dict(copy_gbps=gbps, passed=passed, measurements=len(rep.rows))))
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
