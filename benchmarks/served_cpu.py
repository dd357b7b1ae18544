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
import json
import os
import statistics
import subprocess
import sys

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
    from engine.gpu_report import served as through_server

    out = through_server({**CONFIG, "stream-interval": interval}, PROMPTS, INPUT_LEN, OUTPUT_LEN,
                         ("--cpu-affinity", str(ENGINE_CPU)), {**os.environ, "OMP_NUM_THREADS": "1"})
    return {"output_tok_s": out["output_tok_s"], "step_ms": out["step_ms"], "step_busy": out["step_busy"],
            "http_thread_cpu": out["thread_cpu_per_s"]["main"]}


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
