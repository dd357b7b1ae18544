"""A serving probe that lives as long as its server: it fills the server once and takes one window per sample.

A throughput sample started as a probe of its own fills the server from idle before its window, and on an H200 at
128 sequences that fill was 6-14 s of a 25-40 s sample, paid again for every sample. Where the target fills once
(`Target.fills_once`), the arm's live server gets one driver: `orchestrator.probes.serving --turns`, started at
its first sample, which fills it, pauses it (its requests kept where they are) and waits on stdin. Each sample
then asks for one window: the driver resumes the server, measures, pauses it again and answers with one JSON
line, the probe protocol's result line. Simultaneous arms ask both drivers at once (`ask`, then `answer`), so that
both windows cover the same seconds. The driver ends (`stop`: the server resumed, then the driver's group
killed if it lingers) before anything else talks to its server and before the server stops.

The driver runs in its own process group, carries a process mark and has its row in the processes table, so
`recover` kills it after the orchestrator died, as it kills the server.
"""
from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from orchestrator.probes.marks import marked_env, new_mark, sweep_mark
from orchestrator.probes.runner import ProcessResult, kill_group

STOP_GRACE = 10.0  # seconds a driver told to stop may take to resume its server and exit


class Turns:
    """One running driver; `window` takes a sample, `stop` ends it."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float,
                 on_start: Callable[[int, float], Callable[[], None] | None],
                 on_tick: Callable[[float, str], None] | None = None, tmp_dir: Path | None = None):
        """Start the driver; `filled` waits until it has filled its server (simultaneous arms start both drivers
        first, so that their warm-ups and fills overlap)."""
        self.mark, self._since = new_mark(), time.time() - 5
        self._err = open(Path(tmp_dir or "/tmp") / f"turns-{self.mark}.stderr", "w+b")
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._tick = on_tick
        self.proc = subprocess.Popen(argv, cwd=cwd, env=marked_env(env, self.mark), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, start_new_session=True, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        try:
            create_time = psutil.Process(self.proc.pid).create_time()
        except psutil.Error:
            create_time = time.time()
        self._end = on_start(self.proc.pid, create_time)
        self._timeout = timeout
        self.fill: ProcessResult | None = None  # the first line it answers

    def filled(self) -> ProcessResult | None:
        """Wait (at most the driver's timeout) until it has filled its server: None, or why it could not, the
        driver then stopped."""
        first = self.fill is None
        if first:
            self.fill = self._answer(self._timeout)
        failed = "filled" not in (self.fill.result or {})
        if failed and first:
            self.stop()
        return self.fill if failed else None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _answer(self, timeout: float) -> ProcessResult:
        """The driver's next line as a finished probe's result: its JSON object, or a timeout, or its exit."""
        started = time.monotonic()
        while True:
            elapsed = time.monotonic() - started
            if elapsed >= timeout:
                return self._result(None, True, elapsed)
            try:
                line = self._lines.get(timeout=min(0.5, timeout - elapsed))
            except queue.Empty:
                if self._tick:
                    self._tick(time.monotonic() - started, "")
                continue
            if line is None:  # it exited: its status and what it said
                try:
                    code = self.proc.wait(STOP_GRACE)
                except subprocess.TimeoutExpired:
                    code = None
                return self._result(None, False, time.monotonic() - started, code)
            try:
                result = json.loads(line)
            except ValueError:
                continue  # not a result line
            if isinstance(result, dict):
                failed = "error" in result
                return self._result(line.strip(), False, time.monotonic() - started, 1 if failed else 0, result)

    def _result(self, line: str | None, timed_out: bool, seconds: float, code: int | None = None,
                result: dict | None = None) -> ProcessResult:
        self._err.seek(0)
        err = self._err.read()[-4000:].decode(errors="replace")
        return ProcessResult(code, timed_out, seconds, line or "", err, result=result,
                             result_missing=None if result is not None else "the driver gave no result line")

    def window(self, timeout: float) -> ProcessResult:
        """One measured window, as a probe's result; a driver that fails or times out is stopped."""
        self.ask()
        return self.answer(timeout)

    def ask(self) -> None:
        """Start a window without waiting for it: the drivers of simultaneous arms are asked one right after the
        other, so that their windows cover the same seconds."""
        try:
            self.proc.stdin.write("window\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # it has exited: its answer says how

    def answer(self, timeout: float) -> ProcessResult:
        """The window asked for, as a probe's result; a driver that fails or times out is stopped."""
        result = self._answer(timeout)
        if result.returncode != 0:
            self.stop()
        return result

    def stop(self) -> None:
        """End the driver: asked first (it resumes its server), then its group killed; waits until all are gone."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.close()
            except (BrokenPipeError, ValueError, OSError):
                pass
            try:
                self.proc.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.proc.pid, self.proc.pid)
        self.proc.wait()
        sweep_mark(self.mark, self._since)
        self._err.close()
        Path(self._err.name).unlink(missing_ok=True)
        if self._end is not None:
            self._end()
            self._end = None
