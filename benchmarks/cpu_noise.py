"""How comparable two CPU measurements are, by when and where they run: the noise behind the simultaneous arms.

Two processes do identical work (a fixed Python loop, in units) and report units per second of their own CPU
time over a window, as the serving probe's cpu_score does for a server. Their log ratio would be 0 on a quiet,
steady machine; its spread over many windows is the noise a paired comparison of two arms carries:

- sequential: A alone for one window, then B alone (the interleaved pairs of a GPU run);
- two cores: A and B at the same time, each on a core of its own;
- one core: A and B at the same time, both pinned to one core (the OS interleaves them every few ms).

    python -m benchmarks.cpu_noise [--window 2.5] [--pairs 12]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_noise", description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=float, default=2.5, help="seconds of work per sample")
    p.add_argument("--pairs", type=int, default=12)
    args = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        p.error("needs two cores")
    print(f"| pairing ({args.pairs} pairs, {args.window:g} s windows) | sd of log(A/B) | mean |")
    print("|---|---|---|")
    for mode in ("sequential", "two cores", "one core"):
        logs = [pair(mode, args.window, cpus) for _ in range(args.pairs)]
        print(f"| {mode} | {statistics.stdev(logs):.3f} | {statistics.mean(logs):+.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
