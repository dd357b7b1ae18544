"""Orchestrator overhead outside probes.

1. snapshot + apply + rollback + database writes of a plugin touching 10 files of 1 MB
   (the plugin's verify fails, so it is applied, checked and rolled back; no probe runs);
2. `orchestrator status` on a database holding 10,000 steps (the real CLI in a subprocess).

    python -m benchmarks.overhead [--iterations 20]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from orchestrator.config import load
from orchestrator.context import open_run
from orchestrator.deployment import Deployment
from orchestrator.journal import Journal
from orchestrator.kept import KeptState
from orchestrator.prober import Prober
from orchestrator.plugin import load_all
from orchestrator.stage import Stager
from orchestrator.store import Store, dumps

FILES, SIZE = 10, 1 << 20


def make_project(base: Path) -> Path:
    rng = random.Random(0)
    target = base / "target"
    target.mkdir(parents=True)
    line = "".join(rng.choice("abcdefghij ") for _ in range(99)) + "\n"
    for i in range(FILES):
        (target / f"f{i}.txt").write_text("MARK = 1\n" + line * ((SIZE - 9) // len(line)))
    plugin = base / "plugins" / "ten-files"
    plugin.mkdir(parents=True)
    manifest = {"id": "ten-files",
                "apply": [{"replace": {"path": f"f{i}.txt", "old": "MARK = 1", "new": "MARK = 2"}} for i in range(FILES)],
                "verify": [{"contains": {"path": "f0.txt", "text": "MARK = 3"}}]}
    (plugin / "plugin.yaml").write_text(yaml.safe_dump(manifest))
    config = {"target": {"kind": "files", "root": "target"}, "plugins": "plugins", "state": "state", "probes": []}
    (base / "orchestrator.yaml").write_text(yaml.safe_dump(config))
    return base / "orchestrator.yaml"


def stage_overhead(base: Path, iterations: int) -> dict:
    """Times Stager.stage() of the 10-file plugin: `cold` with an empty blob store, `warm` with blobs present."""
    cold, warm, cpu = [], [], []
    for i in range(iterations):
        project = load(make_project(base / f"cold{i}"))
        store = Store(project.db_path)
        journal = Journal(store, project.state_dir, project.target.roots)
        plugin = load_all(project.plugins_dir, project.target.roots, {})[0]
        run = open_run(project, store, journal, "run")
        stager = Stager(run, Prober(run), KeptState.of([]), Deployment(store, journal))
        before = {p.name: p.read_bytes() for p in project.target.roots["target"].iterdir()}
        t = time.perf_counter()
        stager.stage(plugin)
        cold.append(time.perf_counter() - t)
        for _ in range(3):
            t, c = time.perf_counter(), time.process_time()
            stager.stage(plugin)
            warm.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        after = {p.name: p.read_bytes() for p in project.target.roots["target"].iterdir()}
        assert after == before and store.steps(run.run_id)[-1]["reason"] == "verify_failed"
        store.close()
    return {"cold_median_ms": 1000 * statistics.median(cold), "warm_median_ms": 1000 * statistics.median(warm),
            "warm_cpu_median_ms": 1000 * statistics.median(cpu),
            "cold_samples": len(cold), "warm_samples": len(warm)}


def fill_history(config: Path, runs: int, steps_per_run: int) -> None:
    """Finished runs of judged steps, written through the store's own methods, one transaction per run."""
    project = load(config)
    store = Store(project.db_path)
    outcomes = [("kept", None), ("rolled_back", "no_gain"), ("rolled_back", "regressed"), ("skipped", "not_applicable")]
    decision = {"verdict": "keep", "gain": 0.01, "ci_low": 0.0, "ci_high": 0.02, "n_baseline": 3, "n_candidate": 3,
                "rule": "stat"}
    for _ in range(runs):
        with store.transaction():
            run_id = store.start_run("run", None, "files")
            store.update_run(run_id, baseline=dumps({"score": 100.0}))
            for s in range(steps_per_run):
                outcome, reason = outcomes[s % len(outcomes)]
                step_id = store.new_step(run_id, f"plugin-{s:05d}", "measuring", objective="score")
                store.finish_step(step_id, outcome, reason, gain=0.01 * (s % 7), before_value=100.0, after_value=101.0,
                                  metrics=dumps({"score": 101.0}))
                if s % 2 == 0:
                    store.add_decision(run_id, step_id, "score", decision, [], {})
            store.finish_run(run_id, "finished")
    store.close()


def status_time(config: Path, args: list[str], repeats: int) -> float:
    env = {**os.environ, "COLUMNS": "200"}
    times, cpu = [], []
    for _ in range(repeats):
        t, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", *args, "--config", str(config)],
                       check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - t)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return {"wall_median_ms": 1000 * statistics.median(times), "cpu_median_ms": 1000 * statistics.median(cpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--status-repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        result = {"stage_10x1MB": stage_overhead(base / "stage", args.iterations)}
        for name, runs, per_run in (("status_100_runs_x_100_steps", 100, 100), ("status_1_run_x_10000_steps", 1, 10000)):
            config = make_project(base / name)
            fill_history(config, runs, per_run)
            result[name] = {"json": status_time(config, ["--json"], args.status_repeats),
                            "table": status_time(config, [], args.status_repeats)}
        for what, code in (("bare_python", "pass"), ("cli_import", "import orchestrator.cli")):
            times = []
            for _ in range(args.status_repeats):
                t = time.perf_counter()
                subprocess.run([sys.executable, "-c", code], check=True)
                times.append(time.perf_counter() - t)
            result[f"{what}_wall_median_ms"] = 1000 * statistics.median(times)
        result["load_average"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
