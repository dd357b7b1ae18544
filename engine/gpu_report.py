"""One command for the engine's speed work on one GPU: correctness first, then the figures.

    python -m engine.gpu_report [--model qwen3.6-35b-a3b-dense] [--layers 40] [--full-workload]
                                [--sections checks,graphs,decode,moe,gdn,engine,profile]
    python -m engine.gpu_report --sections moe-tune     # the per-size MoE launch search (~5 min)
    python -m engine.gpu_report --sections engine,served  # offline, then through the HTTP server

``--model``: ``qwen3.6-35b-a3b`` (the default: the hybrid model, 30 Gated DeltaNet and 10 attention
layers) or ``qwen3.6-35b-a3b-dense`` (every layer attention). In order, each section printed as soon
as it is done (a run cut short keeps what it finished):

1. ``checks``: every kernel the fast decode path runs (v2_triton, MoE triton, the fused norms, the
   Gated DeltaNet kernels of a hybrid model, and their torch fallbacks) against the float64
   reference, bf16 and fp16 (``kernels.check``).
2. ``graphs``: greedy tokens with and without CUDA graphs (float32; add bf16 with
   ``--graph-dtypes``; prefix caching off) on the ``small`` preset and on the first
   ``--graph-layers`` layers of ``--model`` (for the hybrid model: three Gated DeltaNet layers and
   an attention layer, state slots in the captured step): graph replay against the same static
   step run eagerly (must be identical) and against the plain eager engine.
3. ``decode``: v2_triton's share of the copy bandwidth at batch 32 and 128, contexts 4K and 8K, over
   a sweep of its launch parameters (tiles, warps, stages, programs per SM, split length), eagerly;
   the default and the best also replayed from a CUDA graph, as the engine runs a decode step; where vLLM can
   be imported (the vLLM payload's /tmp/site on PYTHONPATH), its own Triton decode attention on the same
   workloads (``kernels/vllm_decode.py``: its caches converted to the Triton backends' layout once, each KV split
   whose output agrees with v2_triton's, eager and replayed).
4. ``moe``: MoE triton against the weight-streaming floor and ``torch._grouped_mm``, 1 to 16,384
   tokens, default and best of a few launch configurations.
5. ``gdn`` (a hybrid ``--model``): the Gated DeltaNet layer's small ops (``gdn-fused``: convolution
   update, gates, gated RMSNorm), ``triton`` against ``torch``, eagerly and replayed from a CUDA
   graph, in decode steps of 1 to 256 sequences and an 8,192-token prefill, each against its floor
   (bytes at copy bandwidth); then one Gated DeltaNet layer's decode step at batch 128 with
   ``gdn-fused`` torch and triton (the other keys on their fast variants): the kernels it launches,
   layer and token mixer (torch.profiler), and its GPU time, eager and replayed.
6. ``engine``: ``--model`` (``--layers`` of its layers): kernels launched per decode step and the
   GPU-busy share of a step at batch 128 (torch.profiler), graphs off and on; then output tok/s on
   200 x (1,000 in, 200 out), graphs on and off (``--full-workload``: 200 x (1,000 in, 2,000 out),
   graphs on only; about 4-5 minutes alone).
7. ``profile``: ``--model`` (``--layers`` of its layers) in a steady decode at batch 128, then 200, graphs
   off so that torch.profiler sees every kernel: a few decode steps' GPU time by kernel class (MoE GEMMs,
   MoE routing and alignment, Gated DeltaNet, attention, norms and rope, projections, the rest; a
   kernel's class from its name, ``KERNEL_RULES``), each class against its floor from the model's shapes
   (``decode_floors``: its bytes at copy bandwidth, or its FLOPs at the matmul peak where that is longer),
   the largest gap first; and the step's GPU-busy time against the sum of the floors. Each class's
   costliest kernels are listed, so that a misplaced name shows.

``moe-tune`` (not run by default): per token count, a search over BLOCK_M and each GEMM's tiles;
writes the winners to ``$OUT/moe_configs/`` in the form ``kernels/moe_configs/`` reads.

``served`` (not run by default; it needs the server's and the client's packages, ``benchmarks/make_wheels.sh``):
the engine section's throughput workload through ``engine.server`` and the serving probe's client, every
prompt sent at once, streamed as ``vllm bench serve`` streams (vLLM's figures are served ones): output tok/s
beside the engine section's offline figure where it ran, the server's own step count and busy share, and the
CPU its HTTP thread (the main one) and its engine thread spent per second: one process serves both, so what
the HTTP side holds of the interpreter's lock the engine's step waits for. One server per ``--stream-intervals``
value (default 1 and 4: tokens a streamed response sends together, the HTTP side's lever).

It imports nothing beyond torch, Triton, NumPy, PyYAML and the project. The last lines are a compact
table; every figure also goes to ``$OUT/gpu_report.json`` when OUT is set.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels
from kernels import bench, check

SUMMARY: list[tuple[str, str, str]] = []  # (figure, value, target)
RESULTS: dict = {}


def say(text: str = "") -> None:
    print(text, flush=True)


def summary(figure: str, value: str, target: str = "") -> None:
    SUMMARY.append((figure, value, target))
    say(f"  {figure}: {value}" + (f"  (target {target})" if target else ""))


def _ms(fn, graph: bool = False) -> float | None:
    """Median ms eagerly, or replayed from a CUDA graph (None when ``fn`` cannot be captured)."""
    import triton.testing
    if not graph:
        return float(triton.testing.do_bench(fn, warmup=20, rep=60, return_mode="median"))
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median"))
    except Exception as exc:  # not capturable: reported as such
        say(f"  no graph timing: {type(exc).__name__}: {str(exc)[:120]}")
        torch.cuda.synchronize()
        return None


# ---------------------------------------------------------------- 1. kernel checks
MODELS = ("qwen3.6-35b-a3b", "qwen3.6-35b-a3b-dense")
GDN_FUSED_OPS = ("causal_conv1d", "gdn_gating", "rms_norm_gated")  # the gdn-fused key's
CHECKED = [("paged_decode", "v2_triton"), ("moe", "triton"), ("rms_norm", "triton"), ("qk_norm_rope", "triton"),
           ("rms_norm", "torch"), ("qk_norm_rope", "torch"), ("moe", "grouped_mm")]
CHECKED_HYBRID = [("gated_delta_rule", "triton_recurrent"), ("gated_delta_rule", "triton_chunk"),
                  ("gated_delta_rule", "recurrent")] + [(op, v) for op in GDN_FUSED_OPS for v in ("triton", "torch")]


def _hybrid(model: str) -> bool:
    from engine.model_config import PRESETS
    return PRESETS[model].is_hybrid


def section_checks(args) -> None:
    rows = []
    for op, variant in CHECKED + (CHECKED_HYBRID if _hybrid(args.model) else []):
        for dtype in (torch.bfloat16, torch.float16):
            r = check.run(op, variant, "cuda", dtype)
            rows.append(r)
            say(f"  {op:14s} {variant:10s} {str(dtype)[6:]:9s} passed={r['passed']} worst={r['worst_error']} "
                f"{r.get('error', '')}")
    RESULTS["checks"] = rows
    failed = [f"{r['op']}/{r['variant']}/{r['dtype']}" for r in rows if not r["passed"]]
    summary("kernel checks vs float64 (bf16, fp16)", "all passed" if not failed else "FAILED: " + ", ".join(failed))


# ---------------------------------------------------------------- 2. greedy tokens with and without graphs
FAST = {"attention-decode": ["v2_triton"], "attention-decode-long": ["v2_triton"], "attention-prefill": ["triton"],
        "moe-dispatch": ["triton"], "rms-norm": ["triton"], "qk-norm-rope": ["triton"],
        "gdn-prefill": ["triton_chunk"], "gdn-decode": ["triton_recurrent"], "gdn-fused": ["triton"]}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length + 7 * i % 29,), generator=g).tolist() for i in range(n)]


def _graph_models(args) -> list[tuple[str, dict]]:
    """(label, config keys) of the models the graphs section checks."""
    if args.device == "cpu":  # a smoke run: the tiny presets, every kernel on its torch variant
        return [(name, {"model": name, "device": "cpu"}) for name in ("tiny", SMOKE_MODELS[args.model])]
    return [("small", {"model": "small", "device": "cuda", **FAST}),
            (f"{args.model} x {args.graph_layers} layers",
             {"model": args.model, "num-layers": args.graph_layers, "device": "cuda", **FAST})]


def section_graphs(args) -> None:
    """On the CPU nothing is captured: the "graphs" run goes through the same static steps eagerly."""
    from engine import LLM
    out = {}
    for dtype in args.graph_dtypes.split(","):
        for name, model in _graph_models(args):
            label = f"{name}, {dtype}"
            cfg = {**model, "dtype": dtype, "max-model-len": 1024, "max-num-seqs": 64, "kv-cache-memory": 1 << 30,
                   "enable-prefix-caching": False, "cuda-graphs": True}
            llm = LLM(cfg)
            runner = llm.engine.model_runner
            if args.device == "cpu":
                runner.use_static_decode(capture=False)
            graphs = runner.decode_graphs
            if graphs is None:
                summary(f"graphs, {label}", f"NOT CAPTURED: {runner.graphs_off_reason}", "captured")
                llm.close()
                continue
            prompts = _prompts(args.sizes.graph_prompts, 40, llm.engine.config.vocab_size, 5)
            steps = args.sizes.graph_tokens
            with_graphs = llm.generate(prompts, steps)
            replays, static_steps = graphs.replays, graphs.steps
            runner.decode_graphs = None
            eager = llm.generate(prompts, steps)
            runner.use_static_decode(capture=False)
            static = llm.generate(prompts, steps)
            same_static = with_graphs == static
            tokens = sum(map(len, eager))
            same = sum(a == b for e, g in zip(eager, with_graphs) for a, b in zip(e, g))
            first = min((next((i for i, (a, b) in enumerate(zip(e, g)) if a != b), len(e))
                         for e, g in zip(eager, with_graphs)), default=0)
            out[label] = dict(replays=replays, static_steps=static_steps, identical_to_static_eager=same_static,
                              identical_to_eager=with_graphs == eager, tokens=tokens, same_tokens=same,
                              first_divergence=first, hybrid=llm.engine.config.hf.is_hybrid)
            summary(f"greedy tokens, graphs ({replays} replays of {static_steps} steps) vs the same static step "
                    f"eager ({label})", "identical" if same_static else "DIFFER", "identical")
            summary(f"greedy tokens, graphs vs plain eager ({label})",
                    "identical" if with_graphs == eager else f"{same}/{tokens} same, first divergence at token {first}",
                    "identical")
            del runner, graphs
            llm.close()
    RESULTS["graphs"] = out


# ---------------------------------------------------------------- 3. decode attention
DECODE_SWEEP = ([dict(block_n=bn, num_warps=w, num_stages=st) for bn in (32, 64) for w in (4, 8) for st in (2, 3)]
                + [dict(block_n=32, num_stages=5), dict(programs_per_sm=4), dict(programs_per_sm=16),
                   dict(block_n=32, programs_per_sm=16), dict(min_split=128), dict(min_split=512)])


def section_decode(args, copy_gbps: float) -> None:
    """Each configuration timed eagerly; the default and the best also replayed from a CUDA graph
    (as a captured decode step runs them: no host work between the two kernels)."""
    from kernels import vllm_decode

    fn = kernels.get("paged_decode", "v2_triton")
    theirs, where = vllm_decode.find()
    if theirs is None:
        say(f"  vLLM's Triton decode attention cannot be imported here (the vLLM payload's /tmp/site on PYTHONPATH "
            f"brings it): {where[:300]}")
    rows, best_rows = [], []
    for b, c in [(32, 4096), (128, 4096), (128, 8192)]:
        a, nbytes, _ = bench.decode_workload(batch=b, context=c)
        pct = lambda ms: 100 * nbytes / ms / 1e6 / copy_gbps if ms else float("nan")  # noqa: E731
        default = _ms(lambda: fn(**a))
        best, best_cfg = default, {}
        for cfg in DECODE_SWEEP:
            try:
                ms = _ms(lambda cfg=cfg: fn(**a, **cfg))
            except Exception as exc:  # a configuration out of resources: skip it
                say(f"  skipped {cfg}: {type(exc).__name__}")
                continue
            rows.append(dict(batch=b, context=c, **cfg, ms=ms, pct=pct(ms)))
            if ms < best:
                best, best_cfg = ms, cfg
        default_graph = _ms(lambda: fn(**a), True)
        best_graph = _ms(lambda: fn(**a, **best_cfg), True)
        static = _ms(lambda: fn(**a, max_seq_len=262_144), True)  # a CUDA graph's bound: the model's whole length
        best_rows.append(dict(batch=b, context=c, default_ms=default, default_pct=pct(default), best_ms=best,
                              best_pct=pct(best), best=best_cfg or "default", default_graph_ms=default_graph,
                              default_graph_pct=pct(default_graph), best_graph_ms=best_graph,
                              best_graph_pct=pct(best_graph), graph_bound_pct=pct(static)))
        summary(f"decode v2_triton {b} x {c}", f"graph replay {pct(default_graph):.0f}% of copy BW default, "
                f"{pct(best_graph):.0f}% best ({best_cfg or 'default'}), {pct(static):.0f}% with a 256K bound; "
                f"eager {pct(default):.0f}% default, {pct(best):.0f}% best", ">= 80%")
        if theirs is not None:
            best_rows[-1].update(_against_vllm(theirs, fn, a, default_graph, pct, f"{b} x {c}"))
        del a
        torch.cuda.empty_cache()
    RESULTS["decode"] = dict(copy_gbps=copy_gbps, best=best_rows, sweep=rows)


def _against_vllm(theirs, fn, a: dict, ours_graph_ms: float | None, pct, shape: str) -> dict:
    """vLLM's Triton decode attention on the same workload, in this process: each KV split of
    ``vllm_decode.SPLITS`` whose output agrees with v2_triton's, eager and replayed from a CUDA graph; the
    fastest replay set against v2_triton's default one."""
    from kernels import vllm_decode

    expected = fn(**a).float()
    timed, disagree = {}, []
    for splits in vllm_decode.SPLITS:
        call = vllm_decode.prepared(theirs, **a, num_kv_splits=splits)
        err = (call().float() - expected).abs().max().item()
        if not err <= 2e-2:  # bf16 outputs of two correct kernels differ by rounding only
            disagree.append(f"{splits} splits: max |difference| {err:.3g}")
            continue
        timed[splits] = (_ms(call), _ms(call, True))
        del call
    if disagree:
        say(f"  vLLM's decode at {shape} disagrees with v2_triton: {'; '.join(disagree)}")
    if not timed:
        return {"vllm": "no KV split agreed"}
    splits = min(timed, key=lambda k: timed[k][1] or float("inf"))
    eager, graph = timed[splits]
    row = dict(vllm_splits=splits, vllm_ms=eager, vllm_pct=pct(eager), vllm_graph_ms=graph, vllm_graph_pct=pct(graph))
    if graph and ours_graph_ms:
        row["vllm_over_v2_triton"] = graph / ours_graph_ms
    summary(f"decode vLLM triton {shape}", f"graph replay {pct(graph):.0f}% of copy BW ({splits} splits), eager "
            f"{pct(eager):.0f}%" + (f"; v2_triton's default takes {1 / row['vllm_over_v2_triton']:.2f}x its time"
                                   if "vllm_over_v2_triton" in row else ""), "v2_triton faster")
    return row


# ---------------------------------------------------------------- 4. MoE
MOE_SWEEP = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st) for m, n, k, w, st in [
    (16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 64, 128, 8, 3), (16, 128, 128, 4, 4), (32, 64, 64, 4, 3),
    (32, 128, 128, 4, 2), (64, 64, 64, 4, 3), (128, 128, 64, 8, 3)]]
MOE_SIZES = (1, 8, 64, 256, 512, 1024, 2048, 4096, 16384)


def _cfg_label(cfg: dict) -> str:
    if "gate_up" in cfg:
        return f"M{cfg['BLOCK_M']} " + " ".join(
            f"{g}:" + "/".join(str(cfg[g][k]) for k in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))
            for g in ("gate_up", "down"))
    return "/".join(str(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))


def section_moe(args, copy_gbps: float, mm_tflops: float) -> None:
    """Each variant timed eagerly and replayed from a CUDA graph (as a captured decode step runs it)."""
    tri, gmm = kernels.get("moe", "triton"), kernels.get("moe", "grouped_mm")
    rows = []
    for t in MOE_SIZES:
        a, nbytes, flops = bench.moe_workload(tokens=t)
        floor = max(nbytes / copy_gbps / 1e6, flops / mm_tflops / 1e9)
        graph = t <= 512  # sizes a captured decode step runs
        row = dict(tokens=t, floor_ms=floor, triton_ms=_ms(lambda: tri(**a)), grouped_mm_ms=_ms(lambda: gmm(**a)))
        if graph:
            row.update(triton_graph_ms=_ms(lambda: tri(**a), True), grouped_mm_graph_ms=_ms(lambda: gmm(**a), True))
        key = "triton_graph_ms" if graph and row.get("triton_graph_ms") else "triton_ms"
        graph = key == "triton_graph_ms"
        best, best_cfg = row[key], "default"
        for cfg in MOE_SWEEP:
            try:
                ms = _ms(lambda cfg=cfg: tri(**a, config=cfg), graph)
            except Exception as exc:
                say(f"  skipped {cfg}: {type(exc).__name__}")
                continue
            if ms is not None and ms < best:
                best, best_cfg = ms, _cfg_label(cfg)
        row.update(best_ms=best, best=best_cfg)
        rows.append(row)
        gmm_ms = row.get("grouped_mm_graph_ms") or row["grouped_mm_ms"]
        summary(f"MoE {t} tokens{' (graph replay)' if graph else ''}",
                f"triton {row[key]:.3f} ms = {row[key] / floor:.2f}x floor ({best / floor:.2f}x best, {best_cfg}); "
                f"grouped_mm {gmm_ms:.3f} ms ({row[key] / gmm_ms:.2f}x); eager triton {row['triton_ms']:.3f} vs "
                f"grouped_mm {row['grouped_mm_ms']:.3f}", "<= 1.3x floor at 256; <= grouped_mm")
        if t in (256, 2048):  # where the time goes: routing, alignment, the two GEMMs, the sum
            row["kernels_ms"] = _per_kernel_ms(lambda: tri(**a))
            say("  per kernel: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row["kernels_ms"].items()))
        del a
        torch.cuda.empty_cache()
    RESULTS["moe"] = rows
    RESULTS["moe_routing"] = _routing_rows()


def _routing_rows() -> list[dict]:
    """Routing and alignment at the engine's decode batches with its shared expert folded in (257 router logits a
    token), replayed: rows of logits 514 bytes apart, as an unpadded router gives them, against rows 16-byte
    aligned (engine.layers.moe pads the router), which alone let Triton vectorise the routing kernel's loads."""
    from engine.layers.moe import router_width
    from kernels import moe_triton
    rows = []
    experts = bench.MOE["experts"] + 1
    for t in (128, 200):
        row = dict(tokens=t)
        for label, width in (("unaligned", experts), ("aligned", router_width(experts))):
            logits = torch.randn(t, width, device="cuda", dtype=torch.bfloat16)[:, :experts]
            row[f"{label}_ms"] = _ms(lambda lg=logits: moe_triton.route_and_align(lg, bench.MOE["top_k"], True, 1, 16),
                                     True)
        rows.append(row)
        if row["unaligned_ms"] and row["aligned_ms"]:
            summary(f"MoE routing + alignment, {t} tokens, shared expert (graph replay)",
                    f"rows 16-byte aligned {row['aligned_ms'] * 1e3:.1f} us, unaligned {row['unaligned_ms'] * 1e3:.1f} us")
    return rows


def _per_kernel_ms(fn, calls: int = 5) -> dict[str, float]:
    """GPU time per kernel name and call (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {e.key[:48]: e.device_time_total / 1e3 / calls for e in prof.key_averages()
             if e.device_type == torch.autograd.DeviceType.CUDA}
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


TUNE_BLOCK_M = (16, 32, 64, 128)
TUNE_GEMMS = [dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), c)) for c in [
    (16, 128, 4, 4), (16, 256, 4, 3), (32, 128, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3),
    (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (256, 64, 8, 3)]]


def section_moe_tune(args, copy_gbps: float, mm_tflops: float) -> None:
    """Per token count: each BLOCK_M near the rows per expert, then the gate/up GEMM's tiles with the
    down GEMM's fixed, then the down GEMM's with the best gate/up: vLLM's per-size search, kept
    short. Writes ``$OUT/moe_configs/<file>.json`` in the form ``kernels/moe_configs`` reads
    (copy it there to make it the default on this device)."""
    from kernels import moe_triton
    tri = kernels.get("moe", "triton")
    table, rows = {}, []
    for t in MOE_SIZES:
        a, nbytes, flops = bench.moe_workload(tokens=t)
        floor = max(nbytes / copy_gbps / 1e6, flops / mm_tflops / 1e9)
        graph = t <= 512
        per_expert = t * bench.MOE["top_k"] / bench.MOE["experts"]
        base = moe_triton.table_config(t * bench.MOE["top_k"], bench.MOE["experts"])
        best, best_cfg = _ms(lambda: tri(**a, config=base), graph) or float("inf"), base
        for block_m in [m for m in TUNE_BLOCK_M if m <= max(16, 2 * per_expert)]:  # 1 to 4 of them
            cfg = dict(best_cfg, BLOCK_M=block_m)
            for part in ("gate_up", "down"):
                for gemm in TUNE_GEMMS:
                    trial = dict(cfg, **{part: gemm})
                    try:
                        ms = _ms(lambda trial=trial: tri(**a, config=trial), graph)
                    except Exception as exc:  # out of resources on this device
                        say(f"  skipped {_cfg_label(trial)}: {type(exc).__name__}")
                        continue
                    if ms is not None and ms < best:
                        best, best_cfg, cfg = ms, trial, trial
        table[t] = best_cfg
        rows.append(dict(tokens=t, floor_ms=floor, best_ms=best, config=best_cfg))
        summary(f"MoE tuned {t} tokens{' (graph replay)' if graph else ''}",
                f"{best:.3f} ms = {best / floor:.2f}x floor with {_cfg_label(best_cfg)}")
        del a
        torch.cuda.empty_cache()
    RESULTS["moe_tune"] = rows
    if os.environ.get("OUT"):
        name = moe_triton.config_file_name(bench.MOE["experts"], bench.MOE["hidden"], bench.MOE["intermediate"],
                                           "bfloat16", moe_triton.device_name(torch.device("cuda")))
        path = Path(os.environ["OUT"]) / "moe_configs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({str(t): c for t, c in table.items()}, indent=1))
        say(f"  wrote {path} (copy it to kernels/moe_configs/ to use it)")


# ---------------------------------------------------------------- 5. Gated DeltaNet layers
def _time(fn, device: str, graph: bool = False) -> float | None:
    """Median ms: on CUDA eagerly or replayed from a graph, on the CPU (a smoke run) eagerly only."""
    if device == "cuda":
        return _ms(fn, graph)
    return None if graph else bench.median_ms(fn, device, warmup_ms=0, rep_ms=0)


def _gdn_op_rows(args, copy_gbps: float) -> list[dict]:
    """Each gdn-fused op, triton against torch, at decode sizes (graph replay too) and one prefill."""
    z, device = args.sizes, args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    small = {} if device == "cuda" else {"causal_conv1d": dict(channels=64), "gdn_gating": dict(num_heads=4),
                                         "rms_norm_gated": dict(num_heads=4, head_size=32)}
    rows = []
    for op in GDN_FUSED_OPS:
        for rows_, prefill in [(b, False) for b in z.gdn_batches] + [(z.gdn_prefill, True)]:
            size = dict(batch=1, new_tokens=rows_) if op == "causal_conv1d" and prefill else \
                dict(batch=rows_) if op == "causal_conv1d" else dict(tokens=rows_)
            a, nbytes, _ = bench.WORKLOADS[op](dtype=dtype, device=device, **size, **small.get(op, {}))
            row = dict(op=op, rows=rows_, prefill=prefill, floor_ms=nbytes / copy_gbps / 1e6)
            for variant in ("torch", "triton"):
                fn = kernels.get(op, variant)
                row[f"{variant}_ms"] = _time(lambda: fn(**a), device)
                if not prefill:
                    row[f"{variant}_graph_ms"] = _time(lambda: fn(**a), device, graph=True)
            rows.append(row)
            key = "graph_ms" if row.get("triton_graph_ms") and row.get("torch_graph_ms") else "ms"
            tri, tor = row[f"triton_{key}"], row[f"torch_{key}"]
            summary(f"{op} {'prefill' if prefill else 'decode'} {rows_}{' (graph replay)' if key != 'ms' else ''}",
                    f"triton {tri:.4f} ms ({row['floor_ms'] / tri:.0%} of floor) vs torch {tor:.4f} ms "
                    f"({tor / tri:.1f}x)")
            del a
    return rows


def _gdn_layer_rows(args) -> list[dict]:
    """One Gated DeltaNet layer's decode step with gdn-fused torch, then triton: kernels and GPU time."""
    from engine.config import load_config
    from engine.layer_kernels import decode_kernels, decode_step
    from engine.model_runner import ModelRunner
    z, device = args.sizes, args.device
    base = {"model": args.model, "num-layers": 4, "device": device, "dtype": "bfloat16", "max-model-len": 4096,
            "max-num-seqs": max(z.decode_batch, 8), "kv-cache-memory": 1 << 30, "cuda-graphs": False,
            "enable-prefix-caching": False, **FAST}
    if device == "cpu":
        base.update(model=SMOKE_MODELS[args.model], dtype="float16")  # 16-bit: casts launch as on a GPU
    rows = []
    for fused in ("torch", "triton"):
        runner = ModelRunner(load_config({**base, "gdn-fused": [fused]}))
        launched = decode_kernels(runner, 0, z.decode_batch)
        step = decode_step(runner, 0, z.decode_batch)
        row = dict(gdn_fused=fused, batch=z.decode_batch, kernels=len(launched["layer"]),
                   mixer_kernels=len(launched["mixer"]), kernel_names=launched["layer"])
        timing = ""
        if device == "cuda":  # the smoke run counts only
            row.update({f"{part}{kind}_ms": _ms(step[part], graph) for part in ("layer", "mixer")
                        for kind, graph in (("", False), ("_graph", True))})
            timing = f"; {row['layer_ms']:.3f} ms eager (token mixer {row['mixer_ms']:.3f} ms)"
            if row["layer_graph_ms"] is not None:
                timing += f", {row['layer_graph_ms']:.3f} ms replayed (token mixer {row['mixer_graph_ms']:.3f} ms)"
        rows.append(row)
        summary(f"Gated DeltaNet layer, decode step at batch {z.decode_batch}, gdn-fused {fused}",
                f"{row['kernels']} kernels (token mixer {row['mixer_kernels']}){timing}",
                "<= 15 kernels/layer" if fused == "triton" else "")
        del runner, step
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def section_gdn(args, copy_gbps: float) -> None:
    from engine.kernel_choice import triton_runs
    from engine.model_config import PRESETS
    if not PRESETS[args.model].is_hybrid:
        summary("section gdn", f"skipped: {args.model} has no Gated DeltaNet layer")
        return
    if not triton_runs(torch.device(args.device)):
        summary("section gdn", f"skipped: Triton does not run on {args.device} (TRITON_INTERPRET=1 runs it "
                               "interpreted)")
        return
    RESULTS["gdn"] = dict(copy_gbps=copy_gbps, ops=_gdn_op_rows(args, copy_gbps), layer=_gdn_layer_rows(args))


# ---------------------------------------------------------------- 6. the engine at Qwen3.6-35B-A3B dimensions
def _cuda_kernels(prof) -> list:
    """The profiler's GPU kernels (the driver's copies and fills left out)."""
    return [e for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]


def _kernel_intervals(prof) -> list[tuple[float, float]]:
    return [(e.time_range.start, e.time_range.end) for e in _cuda_kernels(prof)]


def _busy_us(intervals) -> float:
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def _steady_decode(engine, batch: int, prompt_len: int, seed: int) -> None:
    for p in _prompts(batch, prompt_len, engine.config.vocab_size, seed):
        engine.add_request(p, engine.config.max_model_len - len(p))  # never finishing while measured
    while any(s.num_computed_tokens < len(s) - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def _profile_steps(engine, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    cuda = engine.model_runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps
    intervals = []
    if cuda:  # a smoke run on the CPU times the steps only
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        intervals = _kernel_intervals(prof)
    busy = _busy_us(intervals) / 1e3 / steps
    return dict(kernels_per_step=len(intervals) / steps, wall_ms=wall * 1e3, gpu_busy_ms=busy,
                busy_fraction=busy / (wall * 1e3))


def _throughput(engine, num_prompts: int, input_len: int, output_len: int, seed: int) -> dict:
    prompts = _prompts(num_prompts, input_len, engine.config.vocab_size, seed)
    prompts = [p[:input_len] for p in prompts]
    if engine.model_runner.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    ids = [engine.add_request(p, output_len) for p in prompts]
    generated = 0
    digest = hashlib.sha256()  # of every request's tokens in order: two runs that generate the same agree
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            generated += len(o.new_token_ids)
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    elapsed = time.perf_counter() - t0
    for rid in ids:
        digest.update(repr(tokens.get(rid, [])).encode())
    return dict(num_prompts=num_prompts, input_len=input_len, output_len=output_len, elapsed_s=elapsed,
                output_tok_s=generated / elapsed, input_tok_s=num_prompts * input_len / elapsed,
                tokens_sha256=digest.hexdigest())


def _engine_config(args) -> dict:
    if args.device == "cpu":
        return {"model": SMOKE_MODELS[args.model], "device": "cpu", "dtype": "float32", "max-model-len": 256,
                "max-num-seqs": 8, "max-num-batched-tokens": 256, "kv-cache-memory": 1 << 24,
                "enable-prefix-caching": False}
    return {"model": args.model, "num-layers": args.layers, "device": "cuda", "dtype": "bfloat16",
            "max-model-len": 4096, "max-num-seqs": 256, "max-num-batched-tokens": 32768,
            "gpu-memory-utilization": 0.9, "cuda-graphs": True, "enable-prefix-caching": False,
            "mamba-ssm-cache-dtype": args.state_dtype, **FAST}


def _graphs_state(runner) -> str:
    graphs = runner.decode_graphs
    if graphs is None:
        return f"NOT CAPTURED: {runner.graphs_off_reason}"
    return f"captured for {len(graphs.graphs)} batch sizes" if graphs.graphs else "static steps run eagerly (CPU)"


def section_engine(args) -> None:
    from engine.llm_engine import LLMEngine
    z = args.sizes
    t0 = time.perf_counter()
    engine = LLMEngine(_engine_config(args))
    runner = engine.model_runner
    if args.device == "cpu":
        runner.use_static_decode(capture=False)
    startup = time.perf_counter() - t0
    graphs = runner.decode_graphs
    kinds = engine.config.hf.layer_kinds
    layers = len(kinds)
    summary(f"engine start-up ({engine.config.model}, {layers} layers: {kinds.count('linear_attention')} Gated "
            f"DeltaNet, {kinds.count('full_attention')} attention)", f"{startup:.0f} s (warm-up "
            f"{runner.warm_up_seconds:.0f} s); kernels "
            f"{engine.kernel_choice}; graphs: {_graphs_state(runner)}")
    out = dict(model=engine.config.model, layers=layers, startup_s=startup, warm_up_s=runner.warm_up_seconds,
               kernel_choice=engine.kernel_choice, graphs_off_reason=runner.graphs_off_reason)
    _steady_decode(engine, z.decode_batch, z.prompt_len, seed=11)
    for label, g in (("eager", None), ("graphs", graphs)):
        if label == "graphs" and g is None:
            continue
        runner.decode_graphs = g
        prof = _profile_steps(engine, 5)
        if g is not None and g.graphs:  # the GPU time of one replay alone: the profiler may not see into graphs
            graph = g.graphs[g.bucket(z.decode_batch)]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(5):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            prof["replay_ms"] = sorted(times)[2]
            prof["replay_busy_fraction"] = prof["replay_ms"] / prof["wall_ms"]
        out[f"decode_step_{label}"] = prof
        summary(f"decode step at batch {z.decode_batch}, {label}",
                f"{prof['kernels_per_step']:.0f} kernels ({prof['kernels_per_step'] / layers:.1f}/layer), "
                f"{prof['wall_ms']:.1f} ms wall, GPU busy {prof['gpu_busy_ms']:.1f} ms "
                f"({100 * prof['busy_fraction']:.0f}%)"
                + (f"; one replay {prof['replay_ms']:.1f} ms = {100 * prof['replay_busy_fraction']:.0f}% of the step"
                   if "replay_ms" in prof else ""), ">= 85% busy" if g else "<= 20 kernels/layer")
    for rid in list(engine._requests):
        engine.abort(rid)
    # with graphs, synchronous and then with async-scheduling (the same prompts: the same tokens, timed side by side)
    output_len = z.full_output_len if args.full_workload else z.output_len
    runs = [("graphs", graphs, output_len, False), ("graphs_async", graphs, output_len, True)]
    if not args.full_workload:
        runs.append(("eager", None, z.output_len, False))
    for label, g, output_len, overlap in runs:
        if label.startswith("graphs") and g is None:
            continue
        runner.decode_graphs, engine.async_scheduling = g, overlap
        r = _throughput(engine, z.num_prompts, z.input_len, output_len, seed=22 if label == "eager" else 21)
        out[f"throughput_{label}"] = r
        summary(f"engine {z.num_prompts} x ({z.input_len} in, {output_len} out), "
                + label.replace("_async", ", async-scheduling"),
                f"{r['output_tok_s']:.0f} output tok/s ({r['elapsed_s']:.1f} s)",
                ">= 5,000 on 200 x (1000 / 2000)" if label.startswith("graphs") else "")
    engine.async_scheduling = engine.config.async_scheduling
    if "throughput_graphs_async" in out:
        same = out["throughput_graphs_async"]["tokens_sha256"] == out["throughput_graphs"]["tokens_sha256"]
        out["async_scheduling_identical"] = same
        summary("greedy tokens, async-scheduling vs synchronous (graphs)", "identical" if same else "DIFFER")
    if graphs is not None:
        out["static_steps"], out["replays"] = graphs.steps, graphs.replays
    runner.decode_graphs = graphs
    RESULTS["engine"] = out


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads from /proc: its main thread (``main``; the engine server's HTTP side)
    and the rest (``others``: the engine's step loop, torch's threads)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {"main": 0.0, "others": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        out["main" if task.name == str(pid) else "others"] += (int(fields[11]) + int(fields[12])) / ticks
    return out


async def _served_batch(url: str, model: str, workload, pid: int) -> tuple[list, float, dict, dict]:
    """Every request of ``workload`` sent at once and streamed to its end: the outcomes, the wall time, the
    server's counters and its threads' CPU seconds, each as the difference over that time."""
    import asyncio

    from orchestrator.probes.client import send, server_tokens, session

    async with session(workload.num_prompts, 3600) as client:
        before, cpu_before = await server_tokens(url), _thread_cpu(pid)
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(send(client, f"{url}/v1/completions", model, prompt, n)
                                          for prompt, n in workload.requests()))
        elapsed = time.perf_counter() - t0
        after, cpu_after = await server_tokens(url), _thread_cpu(pid)
    counters = {k: after[k] - before[k] for k in after if k in before} if before and after else {}
    return outcomes, elapsed, counters, {k: cpu_after[k] - cpu_before[k] for k in cpu_after}


def section_served(args) -> None:
    z = args.sizes
    output_len = z.full_output_len if args.full_workload else z.output_len
    offline = RESULTS.get("engine", {}).get("throughput_graphs") or RESULTS.get("engine", {}).get("throughput_eager")
    rows = []
    for interval in args.stream_intervals:
        out = served({**_engine_config(args), "stream-interval": interval}, z.num_prompts, z.input_len, output_len)
        if offline and offline["output_len"] == output_len:
            out["offline_output_tok_s"] = offline["output_tok_s"]
            out["served_over_offline"] = out["output_tok_s"] / offline["output_tok_s"]
        rows.append(out)
        cpu = out["thread_cpu_per_s"]
        summary(f"served {z.num_prompts} x ({z.input_len} in, {output_len} out), stream-interval {interval}",
                f"{out['output_tok_s']:.0f} output tok/s ({out['elapsed_s']:.1f} s)"
                + (f", {100 * out['served_over_offline']:.0f}% of offline" if "served_over_offline" in out else "")
                + (f"; steps {out['step_ms']:.1f} ms, busy {100 * out['step_busy']:.0f}%" if "step_ms" in out else "")
                + f"; CPU per second: HTTP thread {cpu['main']:.2f}, the others {cpu['others']:.2f}",
                ">= 6,371 on 200 x (1000 / 2000) (vLLM 0.34.0's defaults, served)" if args.full_workload else "")
    RESULTS["served"] = rows


def served(config: dict, num_prompts: int, input_len: int, output_len: int, server_args: tuple[str, ...] = (),
           env: dict[str, str] | None = None) -> dict:
    """``num_prompts`` x (``input_len`` in, ``output_len`` out) through an engine server of ``config`` (a serve
    config's keys), after one batch of the same shape and 16 tokens out (it compiles Triton kernels outside the
    measure): output tok/s, the server's steps and its threads' CPU per second. ``server_args`` and ``env`` go
    to the server's command line and environment."""
    import asyncio
    import tempfile

    import yaml

    from orchestrator.probes.client import served_model
    from orchestrator.probes.live_server import LiveServer, engine_server_argv
    from orchestrator.probes.workload import Workload

    shape = dict(num_prompts=num_prompts, input_len=input_len, range_ratio=0.0, shared_prefix_fraction=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "serve.yaml"
        path.write_text(yaml.safe_dump(config))
        t0 = time.perf_counter()
        with LiveServer(engine_server_argv(str(path)) + list(server_args), env=env, stop_timeout=30) as server:
            server.wait_healthy(1800)
            startup = time.perf_counter() - t0
            model = asyncio.run(served_model(server.url))
            asyncio.run(_served_batch(server.url, model, Workload(output_len=min(16, output_len), seed=1, **shape),
                                      server.pid))
            outcomes, elapsed, counters, cpu = asyncio.run(_served_batch(
                server.url, model, Workload(output_len=output_len, seed=2, **shape), server.pid))
    failed = [o.error for o in outcomes if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outcomes)} requests failed: {sorted(set(failed))[:3]}")
    out = dict(stream_interval=config.get("stream-interval", 1), num_prompts=num_prompts, input_len=input_len,
               output_len=output_len, startup_s=startup, elapsed_s=elapsed,
               output_tok_s=sum(o.output_tokens for o in outcomes) / elapsed,
               thread_cpu_per_s={k: v / elapsed for k, v in cpu.items()})
    if counters.get("steps"):
        out.update(server_steps=counters["steps"], step_ms=1e3 * counters["step_seconds"] / counters["steps"],
                   step_busy=counters["step_seconds"] / elapsed)
    return out


# ---------------------------------------------------------------- 7. a decode step by kernel class
MOE_GEMMS, ROUTING, GDN, ATTENTION = "MoE GEMMs", "MoE routing and alignment", "Gated DeltaNet", "attention"
NORMS, PROJECTIONS, REST = "norms and rope", "projections", "the rest"
KERNEL_CLASSES = (MOE_GEMMS, ROUTING, GDN, ATTENTION, NORMS, PROJECTIONS, REST)
# (class, pattern): a kernel belongs to the first class whose pattern its name contains (ignoring case),
# else to the rest. This project's Triton kernels go by their function names, anchored (torch has a
# reduce_kernel too); cuBLAS's, CUTLASS's and torch's by the words of their namespaced names on an
# H200; a CPU smoke run's aten ops where their names say it. Torch's elementwise and reduce kernels
# name no layer (the attention output gate, the MoE's sum over experts, casts, the argmax): the rest.
# The rules are for the fast path (FAST): on the torch fallbacks a softmax or a mm may be another class's.
KERNEL_RULES = [
    (MOE_GEMMS, r"^_grouped_gemm|grouped_mm|GroupProblemShape"),  # Triton; torch._grouped_mm's CUTLASS
    (ATTENTION, r"^_(split|reduce|prefill)_kernel|index_put"),  # v2_triton, the prefill; the K/V cache writes
    (GDN, r"^_(recurrent|chunk_prepare|chunk_scan|conv|gating|norm_gated)_kernel|softplus|conv1d|conv_depthwise"
          r"|index_copy|index_fill"),  # torch: the gates, the convolution, the state slots' writes
    (ROUTING, r"^_(route|align)(_[a-z]+)?_kernel|topk|softmax|sort|scatter|index_add|indexFunc|cumsum|DeviceScan"),
    (NORMS, r"^_(rms_norm|qk_norm_rope)_kernel|rms_?norm|layer_?norm|rsqrt|\b(cos|sin)(_kernel|$)"),  # rope angles
    (PROJECTIONS, r"nvjet|gemm|gemv|cutlass|cublas|splitK|^aten::(mm|addmm|linear|matmul)$"),
]
_RULES = [(cls, re.compile(pattern, re.IGNORECASE)) for cls, pattern in KERNEL_RULES]


def kernel_class(name: str) -> str:
    """The class of a kernel (in a CPU smoke run: an op) by its name, as ``KERNEL_RULES`` say."""
    return next((cls for cls, rule in _RULES if rule.search(name)), REST)


def decode_floors(cfg, batch: int, context: float, elt: int, state_elt: int) -> dict[str, tuple[float, float]]:
    """(bytes, FLOPs) each class must move and compute in one decode step of ``batch`` sequences of
    ``context`` tokens (the new one included) of model ``cfg`` (a ``ModelConfig``), weights and
    activations of ``elt`` bytes, recurrent states of ``state_elt`` bytes: what no kernel avoids, so that the time
    a class takes above its floor is what is left to win.

    - MoE GEMMs: the experts the tokens hit, whole (top-k of E: E (1 - (1 - k/E)^B) expected) and a
      shared expert folded into them; x read, the output written.
    - routing and alignment: the router logits read; each token-expert pair's weight and id written
      (float32, int32), then the ids read and the pairs' sorted order written (int32, int32).
    - Gated DeltaNet: the recurrent and convolution states read and written, the input projection's
      output read and the gated norm's written, the convolution's weights.
    - attention: the K/V cache read at ``context``, the new K/V written, q read, the output written.
    - norms and rope: each RMSNorm (two a layer, the final one) reads x and the residual and writes
      both; the q/k norm and rotary read and write q and k.
    - projections: each dense GEMM (qkv/o, in/out, the router, a shared expert not folded into the
      experts, the LM head): its weights and input read, its output written.

    FLOPs only where a class multiplies matrices: the MoE GEMMs, the projections, the attention."""
    h, b, e, k = cfg.hidden_size, batch, cfg.num_experts, cfg.top_k
    inter, shared = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    n, n_attn, n_gdn = cfg.num_layers, cfg.num_attention_layers, cfg.num_linear_layers
    d, heads, kv = cfg.head_size, cfg.num_heads, cfg.num_kv_heads
    folded = int(shared == inter > 0)  # as SparseMoeBlock: the shared expert is one more expert
    pairs, experts = b * (k + folded), e * (1 - (1 - k / e) ** b) + folded
    in_proj, values = cfg.linear_conv_dim + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads, cfg.linear_value_dim
    gemms = ([(e + folded, h)] * n + [(2 * shared, h), (h, shared), (1, h)] * (n if shared and not folded else 0)
             + [(heads * d * (2 if cfg.attn_output_gate else 1) + 2 * kv * d, h), (h, heads * d)] * n_attn
             + [(in_proj, h), (h, values)] * n_gdn + [(cfg.vocab_size, h)])  # (out, in)
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * state_elt
    conv = cfg.linear_conv_dim * (cfg.linear_conv_kernel_dim - 1) * elt
    return {
        MOE_GEMMS: (n * (experts * 3 * h * inter + 2 * b * h) * elt, n * 2 * pairs * 3 * h * inter),
        ROUTING: (n * (b * (e + folded) * elt + 2 * pairs * (4 + 4)), 0),
        GDN: (n_gdn * (b * (2 * state + 2 * conv + (in_proj + values) * elt)
                       + cfg.linear_conv_dim * cfg.linear_conv_kernel_dim * elt), 0),
        ATTENTION: (n_attn * b * (2 * context * kv + 2 * kv + 2 * heads) * d * elt,
                    n_attn * 4 * b * context * heads * d),
        NORMS: (((2 * n + 1) * 4 * h + n_attn * 2 * (heads + kv) * d) * b * elt, 0),
        PROJECTIONS: (sum((o * i + b * (o + i)) * elt for o, i in gemms), sum(2 * b * o * i for o, i in gemms)),
    }


def floor_ms(floors: dict[str, tuple[float, float]], copy_gbps: float, mm_tflops: float) -> dict[str, float]:
    """Each class's floor: its bytes at copy bandwidth, or its FLOPs at the matmul peak where that is longer."""
    return {cls: max(nbytes / copy_gbps / 1e6, flops / mm_tflops / 1e9) for cls, (nbytes, flops) in floors.items()}


def class_rows(kernels: list[tuple[str, float]], steps: int, floors: dict[str, float]) -> list[dict]:
    """One row per class of ``kernels`` ((name, µs) over ``steps`` steps), each class present: per step
    its kernels, ms, share of the kernels' time, floor ms (``floors``; none: 0), ratio to the floor
    and its three costliest kernels; the largest gap to the floor first."""
    by_class: dict[str, dict[str, list]] = {cls: {} for cls in KERNEL_CLASSES}
    for name, us in kernels:
        count_us = by_class[kernel_class(name)].setdefault(name, [0, 0.0])
        count_us[0] += 1
        count_us[1] += us
    total_us = sum(us for _, us in kernels) or 1.0
    rows = []
    for cls, names in by_class.items():
        us = sum(t for _, t in names.values())
        ms, floor = us / 1e3 / steps, floors.get(cls, 0.0)
        top = sorted(names.items(), key=lambda kv: -kv[1][1])[:3]
        rows.append({"class": cls, "kernels": sum(c for c, _ in names.values()) / steps, "ms": ms,
                     "share": us / total_us, "floor_ms": floor, "ratio": ms / floor if floor else None,
                     "top": {name[:120]: t / 1e3 / steps for name, (_, t) in top}})
    return sorted(rows, key=lambda r: r["floor_ms"] - r["ms"])


def _profile_decode(engine, steps: int) -> list[tuple[str, float, float]]:
    """(name, start µs, µs) of each kernel of ``steps`` decode steps; on the CPU (a smoke run) each op
    by its self time, so that nested ops count once."""
    from torch.profiler import ProfilerActivity, profile
    cuda = engine.model_runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        return [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in _cuda_kernels(prof)]
    return [(e.name, e.time_range.start, e.self_cpu_time_total) for e in prof.events()]


def section_profile(args, copy_gbps: float, mm_tflops: float) -> None:
    """Where a decode step's GPU time goes by kernel class, each against its floor, at each batch of
    ``profile_batches``: eager steps (graphs off, so that the profiler sees every kernel)."""
    from engine.llm_engine import LLMEngine
    z, cuda = args.sizes, args.device == "cuda"
    engine = LLMEngine({**_engine_config(args), "cuda-graphs": False})
    cfg, elt = engine.config.hf, torch.empty((), dtype=engine.model_runner.dtype).element_size()
    state = engine.config.state_dtype()
    out = dict(model=engine.config.model, layers=cfg.num_layers, kernel_choice=engine.kernel_choice,
               state_dtype=str(state).removeprefix("torch."),
               copy_gbps=copy_gbps, matmul_tflops=mm_tflops, steps=z.profile_steps, batches=[])
    for batch in z.profile_batches:
        _steady_decode(engine, batch - len(engine.scheduler.running), z.prompt_len, seed=30 + batch)
        engine.step()  # Triton compiles for a new batch size
        running = engine.scheduler.running
        b, context = len(running), sum(s.num_computed_tokens + 1 for s in running) / len(running)
        kernels = _profile_decode(engine, z.profile_steps)
        floors = floor_ms(decode_floors(cfg, b, context, elt, state.itemsize), copy_gbps, mm_tflops)
        rows = class_rows([(name, us) for name, _, us in kernels], z.profile_steps, floors)
        kernel_ms = sum(r["ms"] for r in rows)
        busy = _busy_us([(t, t + us) for _, t, us in kernels]) / 1e3 / z.profile_steps if cuda else kernel_ms
        floor = sum(floors.values())
        out["batches"].append(dict(batch=b, context=context, gpu_busy_ms=busy, kernel_ms=kernel_ms, floor_ms=floor,
                                   rows=rows))
        summary(f"decode step at batch {b} by kernel class (eager, context {context:,.0f})",
                f"{'GPU busy' if cuda else 'CPU ops'} {busy:.2f} ms a step vs floors {floor:.2f} ms "
                f"({busy / floor:.1f}x); largest gap first:")
        for r in rows:
            summary(f"  batch {b}: {r['class']}", f"{r['ms']:7.3f} ms {r['share']:4.0%}, {r['kernels']:4.0f} kernels; "
                    f"floor {r['floor_ms']:7.3f} ms" + (f" ({r['ratio']:.2f}x)" if r["ratio"] else ""))
        for r in rows:
            if r["top"]:
                say(f"  {r['class']}: " + "; ".join(f"{name[:60]} {ms:.3f} ms" for name, ms in r["top"].items()))
    RESULTS["profile"] = out


@dataclass(frozen=True)
class Sizes:
    """Workload sizes: the real ones on a GPU, a few tokens for a smoke run on the CPU."""

    graph_prompts: int = 24
    graph_tokens: int = 48
    decode_batch: int = 128
    prompt_len: int = 1000
    num_prompts: int = 200
    input_len: int = 1000
    output_len: int = 200
    full_output_len: int = 2000
    gdn_batches: tuple[int, ...] = (1, 32, 128, 256)  # decode steps of the gdn section's op timings
    gdn_prefill: int = 8192
    profile_batches: tuple[int, ...] = (128, 200)  # the profile section's steady decode batches, in turn
    profile_steps: int = 3


SMOKE = Sizes(graph_prompts=3, graph_tokens=4, decode_batch=3, prompt_len=20, num_prompts=4, input_len=16,
              output_len=4, full_output_len=6, gdn_batches=(2,), gdn_prefill=8, profile_batches=(2, 3),
              profile_steps=2)
SMOKE_MODELS = {"qwen3.6-35b-a3b": "tiny-hybrid", "qwen3.6-35b-a3b-dense": "tiny"}
SECTIONS = ("checks", "graphs", "decode", "moe", "moe-tune", "gdn", "engine", "served", "profile")
DEFAULT_SECTIONS = ("checks", "graphs", "decode", "moe", "gdn", "engine", "profile")


def _host_ceilings() -> tuple[float, float]:
    """A smoke run's ceilings: the host's copy GB/s (read + write) and float32 matmul TFLOP/s."""
    from kernels.gdn_report import copy_gbps
    a = torch.randn(512, 512)
    return copy_gbps("cpu"), 2 * 512**3 / bench.median_ms(lambda: a @ a, "cpu") / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.gpu_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                   help=f"comma-separated, of {', '.join(SECTIONS)} (moe-tune: a longer MoE search, ~5 min; served: "
                        "needs the server's packages)")
    p.add_argument("--model", default=MODELS[0], choices=MODELS,
                   help="the model of the graphs, engine and profile sections (default: the hybrid one)")
    p.add_argument("--layers", type=int, default=40, help="engine and profile sections: how many of the model's layers")
    p.add_argument("--state-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="engine and profile sections: the Gated DeltaNet recurrent state (mamba-ssm-cache-dtype; "
                        "auto: the model's, float32)")
    p.add_argument("--graph-layers", type=int, default=4,
                   help="graphs section: the first layers of --model (4: three Gated DeltaNet and one attention)")
    p.add_argument("--graph-dtypes", default="float32",
                   help="graphs section: dtypes of the small-preset check (comma-separated, e.g. float32,bfloat16)")
    p.add_argument("--full-workload", action="store_true",
                   help="engine section: 200 x (1,000 in, 2,000 out) with graphs, instead of 200 out on and off")
    p.add_argument("--stream-intervals", default="1,4", type=lambda v: [int(x) for x in v.split(",")],
                   help="served section: the servers' stream-interval, one server each (default: 1,4)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke run of the graphs, gdn, engine and profile sections on the tiny presets, a few "
                        "tokens each (gdn: with TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    sections = args.sections.split(",")
    if args.device == "cpu":
        args.sizes = SMOKE
        sections = [name for name in sections if name in ("graphs", "gdn", "engine", "served", "profile")]
    else:
        args.sizes = Sizes()
        if not torch.cuda.is_available():
            print("gpu_report needs a CUDA device (--device cpu: a smoke run)", file=sys.stderr)
            return 2
        props = torch.cuda.get_device_properties(0)
        say(f"## {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    from kernels.h200_report import ceilings
    copy_gbps = mm_tflops = None
    if args.device == "cpu" and {"gdn", "profile"} & set(sections):  # a smoke run: the floors at the host's
        copy_gbps, mm_tflops = _host_ceilings()
    elif {"decode", "moe", "moe-tune", "gdn", "profile"} & set(sections):
        copy_gbps, mm_tflops = ceilings()
        say(f"ceilings: copy {copy_gbps:.0f} GB/s (read + write), bf16 matmul {mm_tflops:.0f} TFLOP/s")
        RESULTS["ceilings"] = dict(copy_gbps=copy_gbps, matmul_tflops=mm_tflops)
    for name in SECTIONS:
        if name not in sections:
            continue
        say(f"\n### {name}")
        t0 = time.perf_counter()
        try:
            if name == "checks":
                section_checks(args)
            elif name == "graphs":
                section_graphs(args)
            elif name == "decode":
                section_decode(args, copy_gbps)
            elif name == "moe":
                section_moe(args, copy_gbps, mm_tflops)
            elif name == "moe-tune":
                section_moe_tune(args, copy_gbps, mm_tflops)
            elif name == "gdn":
                section_gdn(args, copy_gbps)
            elif name == "engine":
                section_engine(args)
            elif name == "served":
                section_served(args)
            else:
                section_profile(args, copy_gbps, mm_tflops)
        except Exception as exc:  # report and go on: the other sections still measure
            import traceback
            traceback.print_exc()
            summary(f"section {name}", f"FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        say(f"  ({time.perf_counter() - t0:.0f} s)")
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "gpu_report.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"summary": SUMMARY, **RESULTS}, indent=1, default=str))
    width = max(len(f) for f, _, _ in SUMMARY) if SUMMARY else 0
    say("\n## Summary")
    for figure, value, target in SUMMARY:
        say(f"{figure.ljust(width)} | {value}" + (f" | target {target}" if target else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
