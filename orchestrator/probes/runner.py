"""Runs a probe or a command step in its own process group, with a hard timeout and a kept output tail;
at its end nothing it started is left running (see marks.py). A step's process that may change a target root
runs under a keeper (keeper.py), which ends it with the orchestrator and records what it changed."""
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

from orchestrator.probes import keeper as keeper_script
from orchestrator.probes.marks import marked_env, new_mark, scope_of, sweep_mark

TAIL = 4000  # characters of stdout and stderr kept with a measurement
RESULT_SCAN = 8 << 20  # bytes at the end of stdout searched for the result line
MAX_DEPTH = 64  # nesting a result line may have; deeper is refused, not parsed into a crash later
MAX_DIGITS = 300  # digits an integer in a result line may have: any such integer fits a float
# What a failing probe may report as its JSON "reason": a server it started that never became healthy
# (timeout) or exited (crashed) is judged like a probe that ran out of time or died.
REPORTED_REASONS = ("timeout", "crashed")
KEEPER_GRACE = 120  # seconds a keeper may take, once its process ended, to record what the process changed


@dataclass
class Keeper:
    """Where a keeper records the end of a step's process: the state folder, the step (its intent records' step,
    run, plugin and root), the root, and the blob of the root's snapshot."""
    state_dir: Path
    record: dict
    root: Path
    snapshot: Path

    def argv(self, argv: list[str], report: int) -> list[str]:
        spec = {"state": str(self.state_dir), "record": self.record, "root": str(self.root),
                "snapshot": str(self.snapshot), "report": report}
        return [sys.executable, "-I", keeper_script.__file__, json.dumps(spec), "--", *argv]


class UnreadableResult(ValueError):
    """A stdout line that is JSON but cannot be used: nested too deeply or holding a gigantic number."""


@dataclass
class ProcessResult:
    returncode: int | None
    timed_out: bool
    duration: float
    stdout_tail: str
    stderr_tail: str
    result: dict | None = None  # the last stdout line that is a JSON object, read whole
    result_missing: str | None = None  # no such line: what was read instead
    result_unreadable: str | None = None  # the last JSON line could not be used (too deep, too large a number)
    launch_error: str | None = None  # the process could not be started (executable not found, ...)

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode is not None and self.returncode < 0 else None


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_DIGITS:
        raise UnreadableResult(f"an integer of {digits} digits")
    return int(text)


def _depth(value: Any) -> int:
    """Nesting depth, without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            todo.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_object_line(line: str) -> dict | None:
    """The JSON object on `line`, None when it is not one; UnreadableResult when it is JSON we refuse to use."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line, parse_int=_int)
    except RecursionError:
        raise UnreadableResult("JSON nested too deeply to parse") from None
    except UnreadableResult:
        raise
    except ValueError:  # a log line that merely starts with a brace
        return None
    if not isinstance(value, dict):
        return None
    if _depth(value) > MAX_DEPTH:
        raise UnreadableResult(f"JSON nested deeper than {MAX_DEPTH} levels")
    return value


def find_result(path: Path) -> tuple[dict | None, str | None, str | None]:
    """(the last stdout line that is a JSON object, None, None), (None, what was read instead, None) or
    (None, None, why the last JSON line cannot be used).

    The whole line is read however long it is (within the last RESULT_SCAN bytes); log lines after it do not
    hide it; a JSON line too deep or with too large a number ends the search: the probe's answer is unreadable.
    """
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - RESULT_SCAN))
        data = f.read()
    lines = data.decode("utf-8", "replace").split("\n")  # not splitlines(): a JSON string may hold U+2028
    if size > RESULT_SCAN and lines:
        lines = lines[1:]  # the first line is cut
    for line in reversed(lines):
        try:
            found = parse_object_line(line)
        except UnreadableResult as e:
            return None, None, f"its JSON result line is unreadable: {e}"
        if found is not None:
            return found, None, None
    last = next((ln.strip() for ln in reversed(lines) if ln.strip()), None)
    if last is None:
        return None, "no JSON result line: its stdout is empty", None
    shown = last if len(last) <= 200 else last[:200] + "..."
    return None, f"no JSON result line: no line of its stdout is a JSON object (last line: {shown!r})", None


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


def confine(pid: int, cpus: set[int] | None) -> None:
    """A process just started (one thread so far, whose later ones inherit this) on `cpus` only; nothing where
    `cpus` is empty or the affinity cannot be set."""
    if cpus:
        try:
            os.sched_setaffinity(pid, cpus)
        except OSError:
            pass


def move(pid: int, cpus: set[int]) -> None:
    """A running process and its descendants, every thread of each, onto `cpus` only (threads they start later
    inherit it). Twice over, for threads started during the first pass by one not yet moved."""
    for _ in range(2):
        try:
            procs = [psutil.Process(pid)]
            procs += procs[0].children(recursive=True)
        except psutil.Error:
            return
        for p in procs:
            try:
                threads = p.threads()
            except psutil.Error:
                continue
            for t in threads:
                try:
                    os.sched_setaffinity(t.id, cpus)
                except OSError:
                    pass


def kill_group(pid: int, pgid: int | None = None, create_time: float | None = None) -> bool:
    """Kill a process, its process group and every descendant (including ones that left the group); whether the
    process was there to kill."""
    procs = []
    try:
        p = psutil.Process(pid)
        if (create_time is None or abs(p.create_time() - create_time) < 1e-3) and p.status() != psutil.STATUS_ZOMBIE:
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
    return bool(procs)


def _launch_error(e: Exception, argv: list[str], cwd: Path) -> str:
    if isinstance(e, FileNotFoundError) and not Path(cwd).is_dir():
        return f"working folder not found: {cwd}"
    if isinstance(e, FileNotFoundError):
        return f"executable not found: {argv[0]}"
    if isinstance(e, PermissionError):
        return f"not executable: {argv[0]}"
    return f"cannot start {argv[0]}: {getattr(e, 'strerror', None) or e}"


def run_process(argv: list[str], cwd: Path, env: dict[str, str], timeout: float,
                on_start: Callable[[int, float], Callable[[], None] | None] | None = None,
                on_tick: Callable[[float, str], None] | None = None,
                tmp_dir: Path | None = None, keeper: Keeper | None = None) -> ProcessResult:
    """Run to completion or until `timeout`; whatever it leaves running is killed either way: its group, its
    descendants, and every process that inherited its mark (a double-forked daemon in a session of its own).

    `on_start(pid, create_time)` may return a callable run once all of them are gone. A process that
    cannot be started gives a result with `launch_error` set, not an exception. Under a `keeper`, the process
    started (and recorded) is the keeper, and the result is its command's.
    """
    mark = new_mark()
    with tempfile.TemporaryDirectory(dir=tmp_dir, prefix="proc-") as tmp:
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        report = os.pipe() if keeper else None
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            start = time.monotonic()
            since = time.time() - 5  # process start times are rounded to the boot time's second
            try:
                if keeper:
                    proc = subprocess.Popen(keeper.argv(argv_for(argv), report[1]), cwd=cwd, stdout=out, stderr=err,
                                            env={**marked_env(env, mark), keeper_script.ENV: scope_of(keeper.state_dir)},
                                            stdin=subprocess.PIPE, start_new_session=True, pass_fds=(report[1],))
                else:
                    proc = subprocess.Popen(argv_for(argv), cwd=cwd, env=marked_env(env, mark), stdout=out,
                                            stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
            except (OSError, ValueError) as e:  # ValueError: a NUL byte in an argument
                _close(report[0] if report else None)
                return ProcessResult(None, False, 0.0, "", "", launch_error=_launch_error(e, argv, cwd))
            finally:
                _close(report[1] if report else None)  # the keeper holds it now
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
                if keeper:  # it ends its command, records what it changed, then exits
                    proc.stdin.close()
                    try:
                        proc.wait(KEEPER_GRACE)
                    except subprocess.TimeoutExpired:
                        pass
                kill_group(proc.pid, proc.pid)  # on timeout, and leftovers (a server it forgot to stop)
                proc.wait()
                sweep_mark(mark, since)  # and what escaped the group and the tree
                if keeper:
                    with os.fdopen(report[0]) as f:
                        said = f.read().splitlines()
                if on_end:
                    on_end()
            duration = time.monotonic() - start
        returncode, launch_error = _kept(said, argv, cwd, proc.returncode) if keeper else (proc.returncode, None)
        return ProcessResult(returncode, timed_out, duration, _tail(out_path), _tail(err_path),
                             *find_result(out_path), launch_error=launch_error)


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def _kept(said: list[str], argv: list[str], cwd: Path, keeper_status: int | None) -> tuple[int | None, str | None]:
    """(the command's exit status, why it could not start) from what its keeper reported."""
    status = json.loads(said[-1]) if said else {}
    if "returncode" in status:
        return status["returncode"], None
    if "errno" in status:
        return None, _launch_error(OSError(status["errno"], status["error"]), argv, cwd)
    return None, f"its keeper failed (exit status {keeper_status}); see its stderr"


@dataclass
class ProbeResult:
    ok: bool
    reason: str | None  # None when ok; else timeout, crashed, incorrect or probe_failed
    message: str
    metrics: dict[str, Any] = field(default_factory=dict)
    value: float | None = None
    process: ProcessResult | None = None
    server: int | None = None  # the live server it talked to (the staging loop's processes row), if any


def _has_object_line(text: str) -> bool:
    for line in text.splitlines():
        try:
            if parse_object_line(line) is not None:
                return True
        except UnreadableResult:
            return True
    return False


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:80] + "..."


def judge_output(role: str, objective: str | None, result: ProcessResult, timeout: float) -> ProbeResult:
    """Apply the probe protocol to a finished process: it fails closed.

    A correctness probe passes only on exit 0 with a result line (the last stdout line that is a JSON object)
    whose `passed` is literally `true`; a throughput probe needs exit 0 and a finite number at `objective`; a
    configuration probe, exit 0 and a result line with a `configuration` key.
    """
    if result.launch_error:
        return ProbeResult(False, "probe_failed", result.launch_error, process=result)
    if result.timed_out:
        return ProbeResult(False, "timeout", f"killed after its {timeout:g}s timeout", process=result)
    if result.signal:
        name = signal.Signals(result.signal).name if result.signal in signal.Signals._value2member_map_ else result.signal
        return ProbeResult(False, "crashed", f"ended by signal {name}", process=result)
    if result.result_unreadable:
        return ProbeResult(False, "probe_failed", result.result_unreadable, process=result)
    metrics = result.result or {}
    failed = "incorrect" if role == "correctness" else "probe_failed"
    if result.returncode != 0:
        said = metrics.get("message") or metrics.get("error")
        # a probe that waited on something (a server starting) may say why it gave up
        reported = metrics.get("reason")
        return ProbeResult(False, reported if reported in REPORTED_REASONS else failed,
                           f"exited with status {result.returncode}" + (f": {said}" if said else ""),
                           metrics, process=result)
    if result.result is None:
        note = result.result_missing or "no JSON result line"
        if _has_object_line(result.stderr_tail):
            note += "; a JSON line on stderr does not count"
        return ProbeResult(False, failed, note, process=result)
    if role == "configuration":
        if "configuration" not in metrics:
            return ProbeResult(False, "probe_failed", 'its JSON result line has no "configuration" key', metrics,
                               process=result)
        return ProbeResult(True, None, "read", metrics, process=result)
    if role == "correctness":
        if "passed" not in metrics:
            return ProbeResult(False, "incorrect", 'its JSON result line has no "passed" key', metrics, process=result)
        passed = metrics["passed"]
        if passed is True:
            return ProbeResult(True, None, "passed", metrics, process=result)
        if passed is False:
            return ProbeResult(False, "incorrect", str(metrics.get("message") or 'reported "passed": false'),
                               metrics, process=result)
        return ProbeResult(False, "incorrect", f'"passed" is {_shown(passed)}, not the literal true', metrics,
                           process=result)
    value = metrics.get(objective) if objective else None
    try:
        usable = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        usable = False
    if not usable:
        what = "missing" if objective not in metrics else _shown(value)
        return ProbeResult(False, "probe_failed", f"no finite number at {objective!r} in its JSON result line "
                           f"({what})", metrics, process=result)
    return ProbeResult(True, None, "measured", metrics, float(value), process=result)
