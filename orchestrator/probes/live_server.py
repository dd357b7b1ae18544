"""A server process for the probes to measure: started in its own process group, judged healthy by
``GET /health``, and always stopped (SIGTERM, then SIGKILL of the whole group after a grace period)
before the caller goes on. Used by the serving and greedy probes and by anything that wants one
server start to serve several probes (``--base-url``).

    with LiveServer(["vllm", "serve", "--config", "serve.yaml", "--port", "{port}"]) as server:
        server.wait_healthy(900)          # ServerFailed("timeout" | "crashed", ...) with the log's tail
        ...requests to server.url...
    # here the group is gone: every member exited or was killed, and its GPU memory released
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import httpx
import psutil

TAIL = 3000  # characters of the server log quoted in a failure


class ServerFailed(Exception):
    """The server could not be started or did not become healthy. ``reason`` is ``timeout`` (still not
    healthy at the deadline) or ``crashed`` (it could not start or exited); the message is ``summary``
    followed by ``tail``, the end of its log."""

    def __init__(self, reason: str, summary: str, tail: str = ""):
        super().__init__(summary + (f"; its last output:\n{tail}" if tail else ""))
        self.reason, self.summary, self.tail = reason, summary, tail


class Terminated(BaseException):
    """SIGTERM to a probe: unwinds through every ``finally`` so that its server is stopped."""


def on_sigterm(_signum, _frame):
    raise Terminated()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the server child: the kernel sends it SIGTERM if its parent is SIGKILLed, because
    the server's own session puts it out of reach of a kill aimed at the parent's group."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


ENGINE_SERVER = "engine.server"  # the reference engine's OpenAI-compatible server (python -m engine.server)


def engine_server_argv(config: str, host: str = "{host}", port: int | str = "{port}") -> list[str]:
    """The engine's server serving the serve config ``config``; ``{host}`` and ``{port}`` left for LiveServer."""
    return [sys.executable, "-m", ENGINE_SERVER, "--config", config, "--host", host, "--port", str(port)]


LOG_NAME_CHARS = 120  # a file name may hold 255 bytes; a time stamp, a random part and .log follow the label


def log_name(*parts: str) -> str:
    """A file name made of ``parts`` (plugin ids and params, probe names) with anything odd replaced; a name of
    more than LOG_NAME_CHARS keeps its head and a hash of the whole, so that long names stay apart."""
    name = "-".join(re.sub(r"[^A-Za-z0-9._=,-]+", "_", p).strip("_") for p in parts if p) or "server"
    if len(name) > LOG_NAME_CHARS:
        name = f"{name[:LOG_NAME_CHARS - 9]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    return name


def server_label(probe: str) -> str:
    """Names a kept server log after the run, the state being probed and the probe."""
    run_id = os.environ.get("ORCHESTRATOR_RUN_ID")
    plugin = os.environ.get("ORCHESTRATOR_PLUGIN", "")
    return log_name(f"run{run_id}" if run_id else "", plugin, probe)


class LiveServer:
    """One server command. ``{host}`` and ``{port}`` in its argv are filled in (a free port when none
    is given); only those literal placeholders are replaced, so JSON arguments pass untouched.

    ``log_dir``: keep the server's output there (a new file per start); without it the log is a
    temporary file removed once the server is stopped.
    """

    def __init__(self, argv: list[str], *, host: str = "127.0.0.1", port: int | None = None,
                 env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 stop_timeout: float = 15.0, log_dir: str | Path | None = None, log_label: str = "server"):
        self.host, self.port = host, port or free_port(host)
        self.argv = [a.replace("{host}", host).replace("{port}", str(self.port)) for a in argv]
        self.env, self.cwd, self.stop_timeout = env, cwd, stop_timeout
        self.log_dir, self.log_label = (Path(log_dir) if log_dir else None), log_label
        self.proc: subprocess.Popen | None = None
        self.started: float | None = None  # time.monotonic() at start
        self.log_path: Path | None = None
        self.stopped_by: str | None = None  # once stopped: SIGTERM, SIGKILL, or exited (gone before)
        self.leftover: list[int] = []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    # ---------------------------------------------------------------- start

    def start(self) -> "LiveServer":
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            fd, name = tempfile.mkstemp(prefix=f"{log_name(self.log_label)}-{stamp}-", suffix=".log",
                                        dir=self.log_dir)
        else:
            fd, name = tempfile.mkstemp(prefix="live-server-", suffix=".log")
        self.log_path = Path(name)
        try:
            with os.fdopen(fd, "wb") as log:
                log.write(f"$ {shlex.join(self.argv)}\n".encode())
                log.flush()
                self.started = time.monotonic()
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             env=self.env, cwd=self.cwd, preexec_fn=_die_with_parent)
        except OSError as exc:
            self._drop_log()
            raise ServerFailed("crashed", f"cannot start server command {shlex.join(self.argv)}: {exc}") from None
        print(f"live server: started {shlex.join(self.argv)} as pid {self.proc.pid} (its own process group), "
              f"log {self.log_path}", file=sys.stderr, flush=True)
        return self

    def __enter__(self) -> "LiveServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------- state

    def tail(self, limit: int = TAIL) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")

    def age(self) -> float | None:
        """Seconds since the server command was started (at health: its start-up time)."""
        return None if self.started is None else time.monotonic() - self.started

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def members(self) -> list[int]:
        """Live processes of the server's process group."""
        return group_members(self.proc.pid) if self.proc is not None else []

    def cpu_seconds(self) -> float | None:
        """CPU seconds of the server's group so far (``group_cpu_seconds``); None once it is gone."""
        if self.proc is None or self.exited() is not None:
            return None
        return group_cpu_seconds(self.proc.pid)

    def wait_healthy(self, timeout: float, poll: float = 0.25,
                     on_tick: Callable[[float, str], None] | None = None) -> None:
        """Until ``GET /health`` answers 200; ServerFailed when the server exits first or ``timeout``
        seconds pass (never later than that, whatever the server does). ``on_tick(seconds since the
        start, the log's last lines)`` is called between polls."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=min(5.0, max(0.5, timeout))) as client:
            while True:
                if (code := self.exited()) is not None:
                    raise ServerFailed("crashed", f"the server exited with code {code} before becoming healthy",
                                       self.tail())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServerFailed("timeout", f"the server at {self.url} did not answer /health with 200 "
                                                  f"within {timeout:g} s", self.tail())
                if health_ok(client, self.url, min(5.0, left)):
                    return
                if on_tick is not None:
                    on_tick(self.age() or 0.0, self.tail(400))
                time.sleep(min(poll, max(0.0, deadline - time.monotonic())))

    # ---------------------------------------------------------------- stop

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after ``stop_timeout``; returns once no member is left and
        their GPU memory is released (bounded waits: a member that outlives SIGKILL is reported)."""
        if self.proc is None or self.stopped_by is not None:
            return
        # a SIGTERM meanwhile must not cut this short: it is held back and delivered once the server is gone
        held: list[int] = []
        previous = signal.signal(signal.SIGTERM, lambda signum, _frame: held.append(signum))
        try:
            self._stop()
        finally:
            signal.signal(signal.SIGTERM, previous)
            if self.log_dir is None:
                self._drop_log()
        if held:
            signal.raise_signal(signal.SIGTERM)

    def _stop(self) -> None:
        pgid = self.proc.pid
        watched = {pgid, *self.members()}
        self.stopped_by = "exited"  # the whole group was gone before the stop
        for sig, wait in ((signal.SIGTERM, self.stop_timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            self.stopped_by = signal.Signals(sig).name
            if self._wait_gone(wait):
                break
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.leftover = self.members()
        if self.leftover:
            print(f"live server: processes {self.leftover} outlived SIGKILL", file=sys.stderr)
            return
        from engine.gpu_memory import wait_released  # the next server (or engine) needs the card's memory

        if held := wait_released(watched, 30.0):
            print(f"live server: processes {sorted(held)} still hold GPU memory 30 s after exiting",
                  file=sys.stderr)

    def _wait_gone(self, timeout: float) -> bool:
        """Until the server and every member of its group are gone, at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            self.proc.poll()
            if self.proc.returncode is not None and not self.members():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _drop_log(self) -> None:
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    pids = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return pids


def group_cpu_seconds(pgid: int) -> float | None:
    """User plus system CPU time of every live process in group ``pgid`` so far (None when none is
    left). On a shared machine this counts only the time the server really ran, which other
    processes' load does not stretch as it stretches wall time."""
    members = group_members(pgid)
    if not members:
        return None
    total = 0.0
    for pid in members:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def health_ok(client: httpx.Client, base_url: str, timeout: float = 5.0) -> bool:
    try:
        return client.get(f"{base_url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(base_url: str, timeout: float, server: LiveServer | None = None) -> None:
    """``GET /health`` = 200 from a server at ``base_url``; through ``server`` when it is ours."""
    if server is not None:
        return server.wait_healthy(timeout)
    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while not health_ok(client, base_url, min(5.0, max(0.1, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise ServerFailed("timeout", f"the server at {base_url} did not answer /health with 200 "
                                              f"within {timeout:g} s")
            time.sleep(0.25)
