"""What the engine server's HTTP side costs on the CPU: the same engine config and batch offline (``LLMEngine``)
and served (``engine.server`` and the serving probe's client), per stream-interval.

    python -m benchmarks.served_cpu [--rounds 2] [--stream-intervals 1,4]

The engine, offline or served, runs on one core with one torch thread, and the client on another, so that the
two do not share a core; the server's HTTP thread shares the engine's core and interpreter, as it shares the
interpreter (not the core) on a GPU host. Rounds alternate offline and served, so that a drift of the machine
falls on both. Needs two cores. Prints one line per measure and the medians as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

CONFIG = {"model": "tiny-hybrid", "device": "cpu", "dtype": "float32", "max-model-len": 256, "max-num-seqs": 64,
          "max-num-batched-tokens": 4096, "kv-cache-memory": 1 << 28, "enable-prefix-caching": False}
PROMPTS, INPUT_LEN, OUTPUT_LEN = 64, 64, 48
ENGINE_CPU, CLIENT_CPU = 1, 0


def offline() -> dict:
    """In a process of its own, pinned: the engine's batch throughput."""
    code = ("import os, json, torch; os.sched_setaffinity(0, {%d}); torch.set_num_threads(1)\n"
            "from engine.llm_engine import LLMEngine\nfrom engine.gpu_report import _throughput\n"
            "e = LLMEngine(%r)\n_throughput(e, %d, %d, 8, seed=1)\n"
            "print(json.dumps(_throughput(e, %d, %d, %d, seed=2)))"
            % (ENGINE_CPU, CONFIG, PROMPTS, INPUT_LEN, PROMPTS, INPUT_LEN, OUTPUT_LEN))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    return {"output_tok_s": json.loads(out.stdout.splitlines()[-1])["output_tok_s"]}


def served(interval: int) -> dict:
    from engine.gpu_report import _served_batch
    from orchestrator.probes.client import served_model
    from orchestrator.probes.live_server import LiveServer, engine_server_argv
    from orchestrator.probes.workload import Workload

    shape = dict(num_prompts=PROMPTS, input_len=INPUT_LEN, range_ratio=0.0, shared_prefix_fraction=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "serve.yaml"
        config.write_text(yaml.safe_dump({**CONFIG, "stream-interval": interval}))
        argv = engine_server_argv(str(config)) + ["--cpu-affinity", str(ENGINE_CPU)]
        with LiveServer(argv, env={**os.environ, "OMP_NUM_THREADS": "1"}) as server:
            server.wait_healthy(300)
            model = asyncio.run(served_model(server.url))
            asyncio.run(_served_batch(server.url, model, Workload(output_len=8, seed=1, **shape), server.pid))
            outcomes, elapsed, counters, cpu = asyncio.run(_served_batch(
                server.url, model, Workload(output_len=OUTPUT_LEN, seed=2, **shape), server.pid))
    return {"output_tok_s": sum(o.output_tokens for o in outcomes) / elapsed,
            "step_ms": 1e3 * counters["step_seconds"] / counters["steps"],
            "step_busy": counters["step_seconds"] / elapsed, "http_thread_cpu": cpu["main"] / elapsed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.served_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--stream-intervals", default="1,4", type=lambda v: [int(x) for x in v.split(",")])
    args = p.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        p.error("needs two cores: the engine on one, the client on the other")
    os.sched_setaffinity(0, {CLIENT_CPU})
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for label, measure in [("offline", offline)] + [(f"served, stream-interval {i}", lambda i=i: served(i))
                                                        for i in args.stream_intervals]:
            result = measure()
            runs.setdefault(label, []).append(result)
            print(label, {k: round(v, 2) for k, v in result.items()}, flush=True)
    medians = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in runs.items()}
    base = medians["offline"]["output_tok_s"]
    for m in medians.values():
        m["of_offline"] = m["output_tok_s"] / base
    print(json.dumps(medians))
    return 0


if __name__ == "__main__":
    sys.exit(main())
