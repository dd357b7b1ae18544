"""Every performance table of the kernels on one GPU, in one process, against ceilings measured in it.

    python -m kernels.h200_report [--out report.md] [--quick]

First measures the card's copy bandwidth (device-to-device, bytes read plus written) and bf16 matmul
rate (8192³ on random data), then times each variant with ``kernels.bench`` and prints Markdown
tables: decode (batch × context, % of copy bandwidth), prefill (TFLOP/s, % of matmul rate), MoE
(against torch._grouped_mm and the weight-streaming floor). Each table is printed as soon as it
is done, so a run cut short keeps what it finished.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

import kernels
from kernels import bench, moe_triton
from kernels.moe_triton import table_config


class Report:
    def __init__(self, path):
        self.path = path
        self.rows = []  # every measurement, for the JSON dump

    def emit(self, text: str = "") -> None:
        print(text, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(text + "\n")

    def table(self, title: str, header: list[str], rows: list[list]) -> None:
        self.emit(f"\n### {title}\n")
        self.emit("| " + " | ".join(header) + " |")
        self.emit("|" + "---|" * len(header))
        for r in rows:
            self.emit("| " + " | ".join(_fmt(c) for c in r) + " |")


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 100 else f"{c:.0f}"
    return str(c)


def _time(fn) -> float | None:
    """Median ms, or None when the variant fails on this shape (the reason is printed)."""
    try:
        return bench.median_ms(fn, "cuda", warmup_ms=25, rep_ms=100)
    except Exception as exc:  # a variant out of memory or unsupported here: report and go on
        print(f"  skipped: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
        return None


def ceilings() -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s) on random data."""
    src = torch.randn(2**30, device="cuda", dtype=torch.float32)  # 4 GiB
    dst = torch.empty_like(src)
    copy_ms = bench.median_ms(lambda: dst.copy_(src), "cuda")
    gbps = 2 * src.numel() * 4 / copy_ms / 1e6
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench.median_ms(lambda: a @ b, "cuda")
    return gbps, 2 * n**3 / mm_ms / 1e9


def sdpa_decode(args):
    """PyTorch SDPA on the same K/V laid out contiguously and unpaged (gathered once, outside the timing)."""
    from kernels.decode_torch import _gathered
    q, k, v = _gathered(args["query"], args["key_cache"], args["value_cache"], args["block_tables"], args["seq_lens"])
    dt = args["query"].dtype
    q, k, v = q.to(dt).transpose(1, 2).flatten(1, 2)[:, :, None], k.to(dt), v.to(dt)  # q [B, H, 1, d]
    n = int(args["seq_lens"][0])
    k, v = k[:, :, :n].contiguous(), v[:, :, :n].contiguous()
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=args["scale"], enable_gqa=True)


def decode_tables(rep, copy_gbps, quick):
    variants = kernels.variants("paged_decode")[1:]
    batches, contexts = ([32], [4096]) if quick else ([1, 32, 128], [1024, 4096, 8192, 32768])
    rows = []
    for b in batches:
        for c in contexts:
            args, nbytes, _ = bench.decode_workload(batch=b, context=c)
            row = [b, c]
            for v in variants + ["sdpa"]:
                fn = kernels.get("paged_decode", v) if v != "sdpa" else None
                ms = _time(sdpa_decode(args) if v == "sdpa" else (lambda fn=fn: fn(**args)))
                gbps = nbytes / ms / 1e6 if ms else None
                rep.rows.append(dict(table="decode", batch=b, context=c, variant=v, ms=ms, gbps=gbps))
                row += [ms, f"{100 * gbps / copy_gbps:.0f}%" if gbps else "n/a"]
            rows.append(row)
            torch.cuda.empty_cache()
    header = ["batch", "context"] + [h for v in variants + ["sdpa (contiguous)"] for h in (f"{v} ms", f"{v} %BW")]
    rep.table(f"Paged decode, bf16, 16 q heads / 2 kv heads, head 256, block 16 (% of {copy_gbps:.0f} GB/s copy)",
              header, rows)


def decode_tuning(rep, copy_gbps):
    fn = kernels.get("paged_decode", "v2_triton")
    rows = []
    for b, c in [(32, 4096), (128, 32768)]:
        args, nbytes, _ = bench.decode_workload(batch=b, context=c)
        for block_n in (32, 64):
            for warps in (4, 8):
                for stages in (2, 3):
                    ms = _time(lambda: fn(**args, block_n=block_n, num_warps=warps, num_stages=stages))
                    if ms:
                        rows.append([b, c, block_n, warps, stages, ms, f"{100 * nbytes / ms / 1e6 / copy_gbps:.0f}%"])
    rep.table("v2_triton configurations", ["batch", "context", "block_n", "num_warps", "num_stages", "ms", "%BW"], rows)


def sdpa_prefill(args):
    q = args["query"].transpose(0, 1)[None]
    k, v = args["key"].transpose(0, 1)[None], args["value"].transpose(0, 1)[None]
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=args["scale"], enable_gqa=True)


PREFILL_CONFIGS = [(128, 64, 8), (128, 32, 8), (64, 32, 4)]


def prefill_tables(rep, mm_tflops, quick):
    shapes = [(0, 8192)] if quick else [(0, 8192), (8192, 8192), (30720, 2048)]
    rows = []
    tri = kernels.get("prefix_prefill", "triton")
    for ctx, new in shapes:
        args, _, flops = bench.prefill_workload(new_tokens=new, context=ctx)
        cands = [("triton", f"{m}/{n}/{w}", lambda m=m, n=n, w=w: tri(**args, block_m=m, block_n=n, num_warps=w))
                 for m, n, w in PREFILL_CONFIGS]
        cands += [("pregather", "tile 256", lambda: kernels.get("prefix_prefill", "pregather")(**args)),
                  ("loop", "tile 64", lambda: kernels.get("prefix_prefill", "loop")(**args))]
        if ctx == 0:
            cands.append(("sdpa (no cache)", "causal", sdpa_prefill(args)))
        for name, cfg, fn in cands:
            ms = _time(fn)
            tf = flops / ms / 1e9 if ms else None
            rep.rows.append(dict(table="prefill", context=ctx, new=new, variant=name, config=cfg, ms=ms, tflops=tf))
            rows.append([ctx, new, name, cfg, ms, tf, f"{100 * tf / mm_tflops:.0f}%" if tf else "n/a"])
        torch.cuda.empty_cache()
    rep.table(f"Prefix prefill, bf16 causal, 16 q / 2 kv heads, head 256 (% of {mm_tflops:.0f} TFLOP/s matmul)",
              ["context", "new tokens", "variant", "block_m/block_n/warps", "ms", "TFLOP/s", "% matmul"], rows)


MOE_CONFIGS = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st) for m, n, k, w, st in [
    (16, 64, 128, 4, 3), (16, 64, 256, 4, 3), (16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (64, 128, 64, 4, 4),
    (128, 128, 64, 8, 3)]]


def moe_triton_block_m(tokens: int) -> int:
    return table_config(tokens * bench.MOE["top_k"], bench.MOE["experts"])["BLOCK_M"]


def moe_tables(rep, copy_gbps, mm_tflops, quick):
    tokens = [256] if quick else [1, 64, 256, 512, 16384]
    rows, tune = [], []
    tri = kernels.get("moe", "triton")
    for t in tokens:
        args, nbytes, flops = bench.moe_workload(tokens=t)
        floor_ms = max(nbytes / copy_gbps / 1e6, flops / mm_tflops / 1e9)
        row = [t, floor_ms]
        for v in ("gather", "sorted", "grouped_mm", "triton"):
            fn = kernels.get("moe", v)
            ms = _time(lambda: fn(**args))
            rep.rows.append(dict(table="moe", tokens=t, variant=v, ms=ms))
            row.append(ms)
        block_m = moe_triton_block_m(t)
        route_ms = _time(lambda: moe_triton.route_and_align(args["router_logits"], bench.MOE["top_k"], True, 0,
                                                            block_m))
        best = None
        for cfg in MOE_CONFIGS:
            ms = _time(lambda: tri(**args, config=cfg))
            tune.append([t, "/".join(str(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")),
                         ms])
            best = ms if ms and (best is None or ms < best) else best
        tri_ms = row[-1]
        row += [best, route_ms, f"{tri_ms / floor_ms:.2f}x" if tri_ms else "n/a",
                nbytes / tri_ms / 1e6 if tri_ms else None, flops / tri_ms / 1e9 if tri_ms else None]
        rows.append(row)
        torch.cuda.empty_cache()
    rep.table(f"MoE, bf16, 256 experts top-8, hidden 2048, intermediate 512 (floor: max of weight bytes at "
              f"{copy_gbps:.0f} GB/s, FLOPs at {mm_tflops:.0f} TFLOP/s)",
              ["tokens", "floor ms", "gather ms", "sorted ms", "grouped_mm ms", "triton ms", "triton best config ms",
               "routing + align ms (in triton)",
               "triton / floor", "triton GB/s", "triton TFLOP/s"], rows)
    rep.table("moe triton configurations (BLOCK_M/BLOCK_N/BLOCK_K/warps/stages)", ["tokens", "config", "ms"], tune)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.h200_report", description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also append the Markdown here")
    p.add_argument("--json", help="write every measurement here")
    p.add_argument("--quick", action="store_true", help="one shape per table")
    p.add_argument("--tables", default="decode,prefill,moe,tune")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("h200_report needs a CUDA device", file=sys.stderr)
        return 2
    rep = Report(a.out)
    props = torch.cuda.get_device_properties(0)
    copy_gbps, mm_tflops = ceilings()
    rep.emit(f"## {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    rep.emit(f"\nMeasured ceilings: copy {copy_gbps:.0f} GB/s (read + write), bf16 matmul {mm_tflops:.0f} TFLOP/s")
    tables = a.tables.split(",")
    if "decode" in tables:
        decode_tables(rep, copy_gbps, a.quick)
    if "prefill" in tables:
        prefill_tables(rep, mm_tflops, a.quick)
    if "moe" in tables:
        moe_tables(rep, copy_gbps, mm_tflops, a.quick)
    if "tune" in tables:
        decode_tuning(rep, copy_gbps)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(copy_gbps=copy_gbps, matmul_tflops=mm_tflops, rows=rep.rows), f, indent=1)
    print(json.dumps(dict(copy_gbps=copy_gbps, matmul_tflops=mm_tflops, measurements=len(rep.rows))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
