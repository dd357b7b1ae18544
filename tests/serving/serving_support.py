"""Helpers for the serving tests: run the probe as a process, start the engine server, and look
for processes left behind."""
from __future__ import annotations

import json
import os
import sqlite3
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


# The engine target on the CPU at its smallest, staged by the real CLI with its default probes, and one plugin
# with an effect far above the noise. The tests built on it are about servers, not the judge: two pairs always,
# and the candidate (eight times the batch) kept unless its two pairs both lose by far (the interval of two
# pairs is wide), so the CPU's noise cannot change which servers start.
STAGED_CONFIG = """\
target:
  kind: engine
  workspace: ws
  device: cpu
  num_layers: 1
  kernel_checks: none
  objective: cpu_score
  arms: {arms}
  workload: {{num_prompts: 8, input_len: 32, output_len: 16, max_concurrency: 8}}
plugins: plugins
state: state
policy: {{rule: stat, min_pairs: 2, max_pairs: 2, interleave: true, min_gain: 0, on_inconclusive: keep}}
"""
WIDER_BATCH = """\
id: wider-batch
description: eight sequences per step instead of one
targets: [engine]
accept: {implausible_factor: 10}  # a gain of several times is expected
apply:
  - yaml_set: {path: "${serve_config}", key: max-num-seqs, value: 8}
    root: serve
"""


def stage_wider_batch(folder: Path, arms: str, **extra_env: str) -> subprocess.CompletedProcess:
    """`orchestrator run` of STAGED_CONFIG (its pairing `arms`) with the wider-batch plugin in `folder`."""
    (folder / "orchestrator.yaml").write_text(STAGED_CONFIG.format(arms=arms))
    (folder / "plugins" / "wider-batch").mkdir(parents=True)
    (folder / "plugins" / "wider-batch" / "plugin.yaml").write_text(WIDER_BATCH)
    return subprocess.run([PY, "-m", "orchestrator.cli", "run", "--config", "orchestrator.yaml"], cwd=folder,
                          env=env(**extra_env), capture_output=True, text=True, timeout=900)


def query(folder: Path, sql: str) -> list[dict]:
    """Rows of the staged run's database."""
    db = sqlite3.connect(folder / "state" / "orchestrator.db")
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute(sql).fetchall()]
    finally:
        db.close()
