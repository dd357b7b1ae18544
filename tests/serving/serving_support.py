"""Helpers for the serving tests: run the probe as a process, start the engine server, and look
for processes left behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


# Child processes (servers, probes) import the repository's packages, installed or not.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def last_json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "the probe printed nothing"
    return json.loads(lines[-1])


def run_probe(*args: str, timeout: float = 120, **extra_env: str) -> tuple[int, dict, str]:
    proc = subprocess.run([PY, "-m", "orchestrator.probes.serving", *args], capture_output=True,
                          text=True, timeout=timeout, env=env(**extra_env), cwd=REPO)
    return proc.returncode, last_json(proc.stdout), proc.stderr


def alive_with(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) processes other than the probe whose command line holds ``marker``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if (marker in cmdline and "orchestrator.probes.serving" not in cmdline
                and proc.info["status"] != psutil.STATUS_ZOMBIE):
            found.append(proc)
    return found


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


TINY_CONFIG = """\
model: tiny
device: cpu
dtype: float32
max-num-seqs: 8
max-model-len: 256
kv-cache-memory: 16777216
"""


def write_config(folder: Path, text: str = TINY_CONFIG) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "serve.yaml"
    path.write_text(text)
    return path


def start_server(config: Path, *extra: str):
    """The engine server as the probe runs it: its own process group, healthy before return."""
    from orchestrator.probes.live_server import LiveServer

    server = LiveServer([PY, "-m", "engine.server", "--config", str(config), "--port", "{port}", *extra])
    try:
        server.start().wait_healthy(120)
    except BaseException:
        server.stop()
        raise
    return server, server.url
