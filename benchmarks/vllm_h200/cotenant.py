"""Does a sleeping vLLM server slow the awake one? The staged run measures every window but its very first with
another server asleep on the card (the kept state's while a candidate is sampled, a candidate's while the kept one
is), and its first windows, alone, were among its fastest. One server of the kept serve config, measured by the
staged run's own serving probe in three conditions, WINDOWS windows each after one window discarded:

    alone      a fresh server, the only one on the card
    beside     after a second server of the same config was started and put to sleep (it sleeps on, as a
               candidate's does), this one woken
    alone      again, the second server stopped

Started by `run.sh cotenant`:  python3 cotenant.py ORCHESTRATOR_YAML WORK   (WINDOWS, default 4)
Writes WORK/cotenant.json (every window's result, after each window) and prints a table: each condition's mean score and spread.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path

import httpx

from orchestrator.config import load
from orchestrator.probes.runner import argv_for, judge_output, run_process
from orchestrator.targets.vllm import SLEEP_PATHS


def window(project, url: str, seed: int) -> dict:
    """One sample of the staged run's serving probe against the server at `url`, run and judged by the staging
    loop's own runner (its protocol, its timeout, nothing it started left behind)."""
    probe = next(p for p in project.target.probes_against(url) if p["role"] == "throughput")
    env = {**os.environ, **project.target.env(), "ORCHESTRATOR_PAIR": str(seed)}
    done = run_process(argv_for(probe["command"]), Path.cwd(), env, probe["timeout"])
    judged = judge_output("throughput", probe["objective"], done, probe["timeout"])
    return judged.metrics if judged.ok else {"error": judged.message}


def switch(server, way: str) -> None:
    path = SLEEP_PATHS[0 if way == "sleep" else 1]
    httpx.post(server.url + path, timeout=600).raise_for_status()


def started(project, label: str):
    server = project.target.live_server(label=label, beside="sleeping").start()
    try:
        server.wait_healthy(project.target.config.startup_timeout)
    except BaseException:
        server.stop()  # a start that failed leaves nothing on the card
        raise
    return server


def save(results: list[dict], path: Path) -> None:
    """Whole or not at all: a poll reading it mid-write sees the windows before."""
    part = path.with_suffix(".part")
    part.write_text(json.dumps(results))
    os.replace(part, path)


def measure(project, server, condition: str, windows: int, seed: int, results: list[dict], path: Path) -> None:
    """WINDOWS windows after a settling one into `results`, each written to `path` as it comes: a test stopped
    part-way (a lease's end, a kill) leaves every window it took."""
    for i in range(windows + 1):  # the first settles the server and is not counted
        result = {"condition": condition, "window": i, "counted": i > 0, **window(project, server.url, seed + i)}
        print(f"{condition} #{i}{'' if i else ' (settling)'}: " + (
            f"score {result['score']:,.0f}, {result['output_throughput']:,.0f} out tok/s, "
            f"TPOT {result['mean_tpot_ms']:.1f} ms" if "score" in result else f"failed: {str(result['error'])[:300]}"),
            flush=True)
        results.append(result)
        save(results, path)


def table(results: list[dict]) -> list[str]:
    rows = ["| condition | windows | mean score | sd of log score | scores |", "|---|---|---|---|---|"]
    for condition in dict.fromkeys(r["condition"] for r in results):
        scores = [r["score"] for r in results if r["condition"] == condition and r["counted"] and "score" in r]
        sd = statistics.stdev(math.log(s) for s in scores) if len(scores) > 1 else float("nan")
        rows.append(f"| {condition} | {len(scores)} | {statistics.fmean(scores) if scores else float('nan'):,.0f} | "
                    f"{sd:.1%} | {', '.join(f'{s:,.0f}' for s in scores)} |")
    return rows


def main(argv: list[str]) -> int:
    project = load(Path(argv[0]))
    work = Path(argv[1])
    windows = max(2, int(os.environ.get("WINDOWS", "4")))
    results: list[dict] = []
    path = work / "cotenant.json"
    first = second = None
    try:
        first = started(project, "cotenant-first")
        measure(project, first, "alone", windows, 100, results, path)
        switch(first, "sleep")
        second = started(project, "cotenant-second")
        switch(second, "sleep")
        switch(first, "wake")
        measure(project, first, "beside a sleeping server", windows, 200, results, path)
        second.stop()
        second = None
        measure(project, first, "alone again", windows, 300, results, path)
    finally:
        for server in (first, second):
            if server is not None:
                server.stop()
        save(results, path)
    print("\n".join(table(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
