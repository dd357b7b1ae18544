"""How comparable two CPU measurements are, by when and where they run: the noise behind the simultaneous arms.

Two processes do identical work (a fixed Python loop, in units) and report units per second of their own CPU
time over a window, as the serving probe's cpu_score does for a server. Their log ratio would be 0 on a quiet,
steady machine; its spread over many windows is the noise a paired comparison of two arms carries:

- sequential: A alone for one window, then B alone (the interleaved pairs of a GPU run);
- two cores: A and B at the same time, each on a core of its own;
- one core: A and B at the same time, both pinned to one core (the OS interleaves them every few ms).

    python -m benchmarks.cpu_noise [--window 2.5] [--pairs 12]

With ``--engine-aa SERVE.yaml``: an A/A test of the staging loop's simultaneous pairs instead, two engine
servers of that one config pinned to one core and the serving probe (the CPU main job's workload) run on both
at once, from one instant, ``--pairs`` times, with the probes on the other cores or (``--probes-anywhere``)
wherever the OS puts them, and glibc's allocator fixed as the engine target fixes it on a CPU or
(``--default-allocator``) as it comes; prints each pair's log ratio of cpu_score.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

WORKER = """
import os, sys, time, json
os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')})
start_at, window = float(sys.argv[2]), float(sys.argv[3])
time.sleep(max(0.0, start_at - time.time()))
units, c0, end = 0, time.thread_time(), time.time() + window
while time.time() < end:
    x = 0
    for i in range(20_000):
        x += i * i
    units += 1
print(json.dumps({"rate": units / (time.thread_time() - c0)}))
"""


def rate(cpus: str, start_at: float, window: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER, cpus, f"{start_at:.3f}", str(window)],
                            stdout=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> float:
    out, _ = proc.communicate()
    return json.loads(out.strip().splitlines()[-1])["rate"]


def pair(mode: str, window: float, cpus: list[int]) -> float:
    """log(rate A / rate B) of one pair."""
    if mode == "sequential":
        a = result(rate(str(cpus[0]), time.time() + 0.5, window))
        b = result(rate(str(cpus[0]), time.time() + 0.5, window))
        return math.log(a / b)
    start = time.time() + 1.0
    where = (str(cpus[0]), str(cpus[1])) if mode == "two cores" else (str(cpus[0]), str(cpus[0]))
    pa, pb = rate(where[0], start, window), rate(where[1], start, window)
    return math.log(result(pa) / result(pb))


def engine_aa(config: str, pairs: int, cpus: list[int], probes_anywhere: bool, default_allocator: bool) -> list[float]:
    from orchestrator.probes.live_server import LiveServer
    from orchestrator.targets.engine import CPU_ALLOCATOR, CPU_WORKLOAD, server_argv

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           **({} if default_allocator else CPU_ALLOCATOR)}
    w = CPU_WORKLOAD
    servers = [LiveServer(server_argv(config, "{host}", "{port}") + ["--cpu-affinity", str(cpus[0])], env=env)
               for _ in range(2)]
    logs = []
    try:
        for server in servers:
            server.start().wait_healthy(300)
        for n in range(pairs):
            start = time.time() + 3
            procs = [subprocess.Popen([sys.executable, "-m", "orchestrator.probes.serving", "--base-url", s.url,
                                       "--server-pid", str(s.pid), "--num-prompts", str(w.num_prompts),
                                       "--input-len", str(w.input_len), "--output-len", str(w.output_len),
                                       "--max-concurrency", str(w.max_concurrency), "--pair", str(n),
                                       "--start-at", f"{start:.3f}"], stdout=subprocess.PIPE, text=True)
                     for s in servers]
            if not probes_anywhere:
                for proc in procs:
                    os.sched_setaffinity(proc.pid, set(cpus[1:]))
            scores = [json.loads(proc.communicate()[0].strip().splitlines()[-1])["cpu_score"] for proc in procs]
            logs.append(math.log(scores[0] / scores[1]))
            print(f"| {n} | {logs[-1]:+.3f} |", flush=True)
    finally:
        for server in servers:
            server.stop()
    return logs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_noise", description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=float, default=2.5, help="seconds of work per sample")
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--engine-aa", metavar="SERVE.yaml", help="an A/A test of two engine servers of this config")
    p.add_argument("--probes-anywhere", action="store_true", help="with --engine-aa: the probes not pinned")
    p.add_argument("--default-allocator", action="store_true",
                   help="with --engine-aa: glibc's allocator as it comes, not the engine target's CPU_ALLOCATOR")
    args = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        p.error("needs two cores")
    if args.engine_aa:
        print("| pair | log(cpu_score A / B) |\n|---|---|")
        logs = engine_aa(args.engine_aa, args.pairs, cpus, args.probes_anywhere, args.default_allocator)
        print(f"\nsd {statistics.stdev(logs):.3f}, mean {statistics.mean(logs):+.3f}; from the third pair on: "
              f"sd {statistics.stdev(logs[2:]):.3f}, mean {statistics.mean(logs[2:]):+.3f}")
        return 0
    print(f"| pairing ({args.pairs} pairs, {args.window:g} s windows) | sd of log(A/B) | mean |")
    print("|---|---|---|")
    for mode in ("sequential", "two cores", "one core"):
        logs = [pair(mode, args.window, cpus) for _ in range(args.pairs)]
        print(f"| {mode} | {statistics.stdev(logs):.3f} | {statistics.mean(logs):+.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
