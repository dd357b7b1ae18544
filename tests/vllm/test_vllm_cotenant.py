"""benchmarks/vllm_h200/cotenant.py end to end on the stand-in `vllm` (standin/vllm, with vLLM's sleep routes):
one server measured alone, beside a second one asleep, and alone again, read back from the servers' own record."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_vllm_live import REPO, left_behind, standin_env
from test_vllm_sleep import project
from vllm_source import linked


def test_one_server_is_measured_alone_beside_a_sleeping_one_and_alone_again(tmp_path, vllm_pinned):
    folder = project(tmp_path, linked(vllm_pinned, tmp_path / "vllm"), {}, {})
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "vllm_h200" / "cotenant.py"), "orchestrator.yaml",
                           str(work)], cwd=folder, capture_output=True, text=True, timeout=900,
                          env={**standin_env(folder), "WINDOWS": "2"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((work / "cotenant.json").read_text())
    assert [(r["condition"], r["window"], r["counted"]) for r in results] == [
        (c, i, i > 0) for c in ("alone", "beside a sleeping server", "alone again") for i in range(3)]
    assert all(r["score"] > 0 for r in results)
    assert "| beside a sleeping server | 2 |" in done.stdout

    events = [json.loads(line) for line in (folder / "standin" / "record.jsonl").read_text().splitlines()]
    first, second = [e["pid"] for e in events if e["event"] == "start"]
    where = [(e["event"], "first" if e["pid"] == first else "second") for e in events if e["event"] != "completion"]
    assert where == [("start", "first"), ("sleep", "first"), ("start", "second"), ("sleep", "second"),
                     ("wake", "first"), ("stop", "second"), ("stop", "first")]
    served = {e["pid"] for e in events if e["event"] == "completion"}
    assert served == {first}  # every window on the first server
    # the windows beside the second ran while it slept: between its sleep and its stop
    sleep_at = next(e["t"] for e in events if e["event"] == "sleep" and e["pid"] == second)
    stop_at = next(e["t"] for e in events if e["event"] == "stop" and e["pid"] == second)
    assert sum(sleep_at < e["t0"] < stop_at for e in events if e["event"] == "completion") > 0
    assert left_behind(str(folder)) == []


def test_a_test_killed_part_way_leaves_every_window_it_took(tmp_path, vllm_pinned):
    """The lease can end mid-test (no `finally` runs on SIGKILL): each window is on disk as soon as it is taken."""
    folder = project(tmp_path, linked(vllm_pinned, tmp_path / "vllm"), {}, {})
    work = tmp_path / "work"
    work.mkdir()
    test = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "vllm_h200" / "cotenant.py"),
                             "orchestrator.yaml", str(work)], cwd=folder, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**standin_env(folder), "WINDOWS": "4"})
    path = work / "cotenant.json"
    try:
        deadline = time.monotonic() + 600
        while not (path.is_file() and len(json.loads(path.read_text() or "[]")) >= 2):
            assert test.poll() is None and time.monotonic() < deadline, "no two windows written while it ran"
            time.sleep(0.2)
    finally:
        test.kill()
        test.wait()
        for line in left_behind(str(folder)):  # the server it started, in a process group of its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(line.split(":")[0]), signal.SIGKILL)
    results = json.loads(path.read_text())
    assert 2 <= len(results) < 15
    assert [(r["condition"], r["window"]) for r in results[:2]] == [("alone", 0), ("alone", 1)]
    assert all(r["score"] > 0 for r in results)
