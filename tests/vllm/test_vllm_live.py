"""The vllm target's live path end to end: a real `orchestrator run` whose default probes start
`vllm serve` for every state, where `vllm` on PATH is a stand-in (standin/vllm: the project's engine
server behind vLLM's command line) and the installed vLLM whose options the plugins check is the
real 0.10.2 source."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from vllm_source import OPTIMIZATIONS, REPO

STANDIN = Path(__file__).resolve().parent / "standin" / "vllm"

SERVE = """\
# vllm serve --config: the seed's baseline, on the project's tiny model
model: tiny
dtype: float32
max-num-seqs: 1
max-num-batched-tokens: 8192
max-model-len: 512
kv-cache-memory-bytes: 16777216
"""
CONFIG = """\
target:
  kind: vllm
  package: {package}
  serve_config: serve/serve.yaml
  startup_timeout: 30
  stop_timeout: 3
  check_timeout: 300
  server_timeout: 300
  workload: {{num_prompts: 16, input_len: 32, output_len: 32, max_concurrency: 16}}
  objective: cpu_score  # the server's own CPU time: other load on a shared machine does not stretch it
plugins: plugins
state: state
policy: {{rule: first, repeats: 1, interleave: false, min_gain: 0.3, min_pairs: 1, max_pairs: 1}}
"""
PLUGIN = """\
id: {id}
description: {id}
order: {order}
targets: [vllm]
apply:
  - yaml_set: {{path: "${{serve_config}}", key: {key}, value: {value}}}
    root: serve
"""
TEST_PLUGINS = {  # id: (order, serve-config key, value)
    "wider-batch": (10, "max-num-seqs", 8),  # a real throughput difference: 8 sequences per step instead of 1
    "bad-value": (20, "max-num-seqs", 0),  # the server rejects it at start
    "other-seed": (30, "seed", 1),  # other weights: every greedy output differs
    "stall": (40, "standin-stall", "true"),  # never answers /health
    "stubborn": (50, "standin-ignore-sigterm", "true"),  # a group member that ignores SIGTERM
}
SHIPPED = ("async-scheduling", "cudagraph-capture-size")  # 0.10.2 has the first option, not the second


def standin_env(tmp_path: Path) -> dict[str, str]:
    """`vllm` and the `python3` it runs on PATH first; the repository importable by every process."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, target in (("vllm", STANDIN), ("python3", Path(sys.executable))):
        if not (bin_dir / name).exists():
            (bin_dir / name).symlink_to(target)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STANDIN_DIR": str(tmp_path / "standin"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def left_behind(marker: str) -> list[str]:
    """Live processes whose command line names ``marker`` (the test's folder)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if marker in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(f"{proc.pid}: {cmdline[:200]}")
    return found


@pytest.fixture
def deployment(tmp_path, vllm_pinned):
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "serve.yaml").write_text(SERVE)
    plugins = tmp_path / "plugins"
    for pid, (order, key, value) in TEST_PLUGINS.items():
        (plugins / pid).mkdir(parents=True)
        (plugins / pid / "plugin.yaml").write_text(PLUGIN.format(id=pid, order=order, key=key, value=value))
    for pid in SHIPPED:
        shutil.copytree(OPTIMIZATIONS / pid, plugins / pid)
    (tmp_path / "orchestrator.yaml").write_text(CONFIG.format(package=vllm_pinned))
    return tmp_path


def cli(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "--config", "orchestrator.yaml"],
                          cwd=folder, env=standin_env(folder), capture_output=True, text=True, timeout=1500)


def measurements(folder: Path, plugin: str) -> list[dict]:
    db = sqlite3.connect(folder / "state" / "orchestrator.db")
    db.row_factory = sqlite3.Row
    rows = db.execute("SELECT m.* FROM measurements m LEFT JOIN steps s ON s.id = m.step_id "
                      "WHERE coalesce(s.plugin, 'baseline') = ?", (plugin,)).fetchall()
    db.close()
    return [dict(r) for r in rows]


def test_live_run_keeps_rolls_back_and_leaves_nothing_behind(deployment):
    run = cli(deployment, "run")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    status = json.loads(cli(deployment, "status", "--json").stdout)
    assert status["run"]["status"] == "finished", status["run"]
    steps = {s["plugin"]: s for s in status["steps"]}

    # the baseline: recorded greedy outputs, measured by the serving benchmark of a live server
    assert json.loads((deployment / "state" / "vllm-reference.json").read_text())["model"] == "tiny"
    assert status["baseline"]["completed"] == 16 and status["baseline"]["score"] > 0
    # kept on a real throughput difference
    wider = steps["wider-batch"]
    assert (wider["outcome"], wider["reason"]) == ("kept", None), wider
    assert wider["gain"] > 0.3
    assert wider["metrics"]["output_tokens_per_cpu_second"] > status["baseline"]["output_tokens_per_cpu_second"]
    # a value the server rejects at start: rolled back, and the run went on
    bad = steps["bad-value"]
    assert bad["outcome"] == "rolled_back" and bad["reason"] in ("crashed", "incorrect"), bad
    assert "exited with code 2" in bad["detail"], bad["detail"]
    # a greedy mismatch
    seed = steps["other-seed"]
    assert (seed["outcome"], seed["reason"]) == ("rolled_back", "incorrect"), seed
    assert "differ from the baseline" in seed["detail"]
    # a server that never becomes healthy
    stall = steps["stall"]
    assert (stall["outcome"], stall["reason"]) == ("rolled_back", "timeout"), stall
    assert "did not answer /health" in stall["detail"]
    # the option the installed vLLM lacks, read from its source
    graphs = steps["cudagraph-capture-size"]
    assert (graphs["outcome"], graphs["reason"]) == ("skipped", "not_applicable"), graphs
    assert "has no serve option --max-cudagraph-capture-size" in graphs["detail"]
    # a shipped plugin the stand-in accepts and ignores: applied, verified, measured, decided
    asynchronous = steps["async-scheduling"]
    assert asynchronous["outcome"] in ("kept", "rolled_back") and asynchronous["gain"] is not None, asynchronous
    # a server that ignores SIGTERM is killed, and no probe is blamed for it
    stubborn = [m for m in measurements(deployment, "stubborn") if m["arm"] == "candidate"]
    assert len(stubborn) == 2 and all(json.loads(m["metrics"]).get("server_stopped_by") == "SIGKILL" for m in stubborn)
    assert steps["stubborn"]["outcome"] in ("kept", "rolled_back")
    assert steps["stubborn"]["reason"] not in ("crashed", "incorrect", "timeout", "probe_failed")
    baseline = measurements(deployment, "baseline")
    assert {json.loads(m["metrics"]).get("server_stopped_by") for m in baseline} == {"SIGTERM"}

    assert left_behind(str(deployment)) == []
    serve = (deployment / "serve" / "serve.yaml").read_text()
    assert "max-num-seqs: 8\n" in serve and "seed:" not in serve and "stall" not in serve
    assert list((deployment / "state" / "server-logs").glob("*.log")), "server logs are kept"


def test_both_probes_share_one_running_server(tmp_path, vllm_pinned):
    """The API the staging loop uses to start one server per state: the target's live server, then
    its default probes aimed at it with --base-url; the probes leave the server running."""
    from orchestrator.config import load

    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "serve.yaml").write_text(SERVE)
    (tmp_path / "plugins").mkdir()
    (tmp_path / "orchestrator.yaml").write_text(CONFIG.format(package=vllm_pinned))
    project = load(tmp_path / "orchestrator.yaml")
    env = {**standin_env(tmp_path), "ORCHESTRATOR_PLUGIN": "baseline", **project.target.env()}
    server = project.target.live_server(env, label="shared")
    try:
        server.start().wait_healthy(project.target.config.startup_timeout)
        results = {}
        for spec in project.target.probes_against(server.url, server.pid):
            assert spec["command"][spec["command"].index("--base-url") + 1] == server.url
            argv = [sys.executable, *spec["command"][1:]]
            proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=spec["timeout"])
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
            results[spec["name"]] = json.loads(proc.stdout.splitlines()[-1])
            assert server.exited() is None, "a probe stopped the shared server"
    finally:
        server.stop()
    assert results["greedy"]["passed"] and results["greedy"]["recorded"]
    assert results["serving"]["completed"] == 16 and results["serving"]["cpu_score"] > 0  # the objective here
    assert server.stopped_by == "SIGTERM" and left_behind(str(tmp_path)) == []
