"""Runs a probe or a command step in its own process group, with a hard timeout and a kept output tail."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

TAIL = 4000
# What a failing probe may report as its JSON "reason": a server it started that never became healthy
# (timeout) or exited (crashed) is judged like a probe that ran out of time or died.
REPORTED_REASONS = ("timeout", "crashed")


@dataclass
class ProcessResult:
    returncode: int | None
    timed_out: bool
    duration: float
    stdout_tail: str
    stderr_tail: str

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode is not None and self.returncode < 0 else None

    def last_json(self) -> Any:
        for line in reversed(self.stdout_tail.splitlines()):
            if line.strip():
                try:
                    return json.loads(line)
                except ValueError:
                    return None
        return None


def argv_for(command: list[str]) -> list[str]:
    """`python` means the orchestrator's own interpreter, so probes see the same packages."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - TAIL))
        return f.read().decode("utf-8", "replace")


def kill_group(pid: int, pgid: int | None = None, create_time: float | None = None) -> None:
    """Kill a process, its process group and every descendant (including ones that left the group)."""
    procs = []
    try:
        p = psutil.Process(pid)
        if create_time is None or abs(p.create_time() - create_time) < 1e-3:
            procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        pass
    if pgid is not None and pgid > 1 and pgid != os.getpgrp():
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def run_process(argv: list[str], cwd: Path, env: dict[str, str], timeout: float,
                on_start: Callable[[int, float], Callable[[], None] | None] | None = None,
                on_tick: Callable[[float, str], None] | None = None,
                tmp_dir: Path | None = None) -> ProcessResult:
    """Run to completion or until `timeout`; whatever it leaves running in its group is killed either way.

    `on_start(pid, create_time)` may return a callable run once the process group is gone.
    """
    with tempfile.TemporaryDirectory(dir=tmp_dir, prefix="proc-") as tmp:
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            start = time.monotonic()
            proc = subprocess.Popen(argv_for(argv), cwd=cwd, env=env, stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            on_end = None
            timed_out = False
            try:
                try:
                    create_time = psutil.Process(proc.pid).create_time()
                except psutil.Error:
                    create_time = time.time()
                on_end = on_start(proc.pid, create_time) if on_start else None
                while True:
                    try:
                        proc.wait(timeout=0.05)
                        break
                    except subprocess.TimeoutExpired:
                        elapsed = time.monotonic() - start
                        if elapsed >= timeout:
                            timed_out = True
                            break
                        if on_tick:
                            on_tick(elapsed, _tail(out_path)[-400:] or _tail(err_path)[-400:])
            finally:
                kill_group(proc.pid, proc.pid)  # on timeout, and leftovers (a server it forgot to stop)
                proc.wait()
                if on_end:
                    on_end()
            duration = time.monotonic() - start
        return ProcessResult(proc.returncode, timed_out, duration, _tail(out_path), _tail(err_path))


@dataclass
class ProbeResult:
    ok: bool
    reason: str | None  # None when ok; else timeout, crashed, incorrect or probe_failed
    message: str
    metrics: dict[str, Any] = field(default_factory=dict)
    value: float | None = None
    process: ProcessResult | None = None


def judge_output(role: str, objective: str | None, result: ProcessResult, timeout: float) -> ProbeResult:
    """Apply the probe protocol to a finished process."""
    if result.timed_out:
        return ProbeResult(False, "timeout", f"killed after its {timeout:g}s timeout", process=result)
    if result.signal:
        name = signal.Signals(result.signal).name if result.signal in signal.Signals._value2member_map_ else result.signal
        return ProbeResult(False, "crashed", f"ended by signal {name}", process=result)
    data = result.last_json()
    metrics = data if isinstance(data, dict) else {}
    failed = "incorrect" if role == "correctness" else "probe_failed"
    if result.returncode != 0:
        # a probe that waited on something (a server starting) may say why it gave up
        reported = metrics.get("reason")
        return ProbeResult(False, reported if reported in REPORTED_REASONS else failed,
                           f"exited with status {result.returncode}", metrics, process=result)
    if role == "correctness":
        if metrics.get("passed") is False:
            return ProbeResult(False, "incorrect", str(metrics.get("message") or 'reported "passed": false'),
                               metrics, process=result)
        return ProbeResult(True, None, "passed", metrics, process=result)
    value = metrics.get(objective) if objective else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return ProbeResult(False, "probe_failed", f"no finite number at {objective!r} in its last JSON line",
                           metrics, process=result)
    return ProbeResult(True, None, "measured", metrics, float(value), process=result)
