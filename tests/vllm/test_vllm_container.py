"""The container without Docker: the entry point script with recording fakes of `orchestrator` and
`vllm` on PATH, and the Dockerfile through hadolint."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.config import load
from vllm_source import OPTIMIZATIONS, REPO

ENTRYPOINT = REPO / "docker" / "entrypoint.sh"

FAKE = """#!/usr/bin/env bash
# records its argv (one line per call) and exits with $FAKE_<NAME>_STATUS
printf '%s\\n' "$(basename "$0") $* VLLM_USE_V1=${VLLM_USE_V1:-unset}" >> "$FAKE_LOG"
if [[ ${FAKE_SLEEP:-} && $1 == run ]]; then
    trap 'echo "terminated" >> "$FAKE_LOG"; exit 143' TERM
    echo started >> "$FAKE_LOG"
    sleep "$FAKE_SLEEP" & wait $!
fi
name=$(basename "$0" | tr a-z A-Z)
status_var="FAKE_${name}_STATUS_${1^^}"
exit "${!status_var:-0}"
"""


@pytest.fixture
def box(tmp_path):
    """(env, state folder, log file) with fake executables first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("orchestrator", "vllm"):
        (bin_dir / name).write_text(FAKE)
        (bin_dir / name).chmod(0o755)
    state, log = tmp_path / "state", tmp_path / "calls.log"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "FAKE_LOG": str(log),
           "ORCHESTRATOR_HOME": str(REPO), "ORCHESTRATOR_STATE": str(state), "VLLM_USE_V1": "0"}
    return env, state, log


def start(env, *args, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ENTRYPOINT), *args], env={**env, **extra}, capture_output=True, text=True,
                          timeout=60)


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_first_start_writes_configs_stages_then_serves(box):
    env, state, log = box
    result = start(env, "--port", "8001", MODEL="Qwen/Qwen3-30B-A3B")
    assert result.returncode == 0, result.stderr
    assert calls(log) == [f"orchestrator run --config {state}/orchestrator.yaml VLLM_USE_V1=0",
                          f"vllm serve --config {state}/serve/serve.yaml --port 8001 VLLM_USE_V1=0"]
    serve = (state / "serve" / "serve.yaml").read_text()
    assert serve.startswith("model: Qwen/Qwen3-30B-A3B\n") and "max-num-seqs: 1\n" in serve
    project = load(state / "orchestrator.yaml")
    assert project.target.kind == "vllm"
    assert project.plugins_dir == OPTIMIZATIONS and project.state_dir == state
    assert project.target.serve_config == state / "serve" / "serve.yaml"
    assert not project.state_dir.is_relative_to(project.target.serve_config.parent)  # the serve root
    assert [p.name for p in project.probes] == ["kernels", "greedy", "serving"]  # live: on `vllm serve`
    # staged as the H200 runs are: the seed's workload in steady state, sleep mode where the image's vLLM has it,
    # an A/A calibration first and every decision judged by an interval
    workload = project.target.config.workload
    assert (workload.max_concurrency, workload.input_len, workload.output_len, workload.duration) == \
        (128, 1000, 200, 10)
    assert project.target.config.sleep == "auto"
    assert project.policy.rule == "stat" and project.policy.calibrate.starts == 3


def test_the_first_start_arguments_are_staged_with_but_not_its_address(box):
    env, state, log = box
    args = ["--max-model-len", "4096", "--port", "8001", "--host=0.0.0.0", "--additional-config", '{"a": "#1"}']
    assert start(env, *args, MODEL="m").returncode == 0
    project = load(state / "orchestrator.yaml")
    assert project.target.config.serve_args == ["--max-model-len", "4096", "--additional-config", '{"a": "#1"}']
    assert calls(log)[-1] == f"vllm serve --config {state}/serve/serve.yaml {' '.join(args)} VLLM_USE_V1=0"


def test_later_starts_keep_the_edited_configs(box):
    env, state, log = box
    assert start(env, MODEL="first/model").returncode == 0
    (state / "serve" / "serve.yaml").write_text("model: my/model\nmax-num-seqs: 256\n")
    config = (state / "orchestrator.yaml").read_bytes()
    assert start(env, MODEL="second/model").returncode == 0
    assert (state / "serve" / "serve.yaml").read_text() == "model: my/model\nmax-num-seqs: 256\n"
    assert (state / "orchestrator.yaml").read_bytes() == config


def test_without_a_model_nothing_starts_and_nothing_is_written(box):
    env, state, log = box
    result = start(env)
    assert result.returncode == 2
    assert "set MODEL" in result.stderr and "serve.yaml" in result.stderr
    assert not state.exists() and calls(log) == []
    (state / "serve").mkdir(parents=True)
    (state / "serve" / "serve.yaml").write_text("max-num-seqs: 1\n")
    result = start(env, MODEL="ignored/model")
    assert result.returncode == 2 and "names no model" in result.stderr
    assert (state / "serve" / "serve.yaml").read_text() == "max-num-seqs: 1\n" and calls(log) == []


def test_a_volume_with_serve_yaml_beside_the_state_is_refused_with_what_to_move(box):
    """An earlier image kept serve.yaml at the top of the volume: its folder, a target root, held the state."""
    env, state, log = box
    state.mkdir()
    (state / "serve.yaml").write_text("model: m\n")
    (state / "orchestrator.yaml").write_text("target:\n  kind: vllm\n  serve_config: serve.yaml\nstate: .\n")
    before = {p.name: p.read_bytes() for p in state.iterdir()}
    result = start(env, MODEL="m")
    assert result.returncode == 2 and calls(log) == []
    assert f"move it to {state}/serve/serve.yaml" in result.stderr
    assert {p.name: p.read_bytes() for p in state.iterdir()} == before


def test_a_failed_run_is_recovered_before_serving(box):
    env, state, log = box
    result = start(env, MODEL="m", FAKE_ORCHESTRATOR_STATUS_RUN="1")
    assert result.returncode == 0, result.stderr
    assert [c.split(" --config")[0] for c in calls(log)] == ["orchestrator run", "orchestrator recover", "vllm serve"]


def test_a_rejected_config_serves_nothing(box):
    env, state, log = box
    result = start(env, MODEL="m", FAKE_ORCHESTRATOR_STATUS_RUN="2")
    assert result.returncode == 2 and "rejected the configuration" in result.stderr
    assert [c.split(" --config")[0] for c in calls(log)] == ["orchestrator run"]


def test_a_failed_recovery_serves_nothing(box):
    env, state, log = box
    result = start(env, MODEL="m", FAKE_ORCHESTRATOR_STATUS_RUN="1", FAKE_ORCHESTRATOR_STATUS_RECOVER="1")
    assert result.returncode == 1
    assert [c.split(" --config")[0] for c in calls(log)] == ["orchestrator run", "orchestrator recover"]


def test_skip_run_serves_the_kept_configuration(box):
    env, state, log = box
    assert start(env, MODEL="m", ORCHESTRATOR_SKIP_RUN="1").returncode == 0
    assert [c.split(" --config")[0] for c in calls(log)] == ["vllm serve"]


def test_the_kept_serve_environment_reaches_the_served_vllm(box):
    """What kept plugins wrote into serve-env.yaml beside the serve config is in the served vLLM's environment, over
    the container's; a bad file serves nothing and says which file and key."""
    env, state, log = box
    assert start(env, MODEL="m", ORCHESTRATOR_SKIP_RUN="1").returncode == 0
    (state / "serve" / "serve-env.yaml").write_text("VLLM_USE_V1: '1'\n")
    assert start(env, MODEL="m", ORCHESTRATOR_SKIP_RUN="1").returncode == 0
    assert calls(log)[-1] == f"vllm serve --config {state}/serve/serve.yaml VLLM_USE_V1=1"
    (state / "serve" / "serve-env.yaml").write_text("VLLM_USE_V1: true\n")
    bad = start(env, MODEL="m", ORCHESTRATOR_SKIP_RUN="1")
    assert bad.returncode == 2 and len(calls(log)) == 2
    assert f"{state}/serve/serve-env.yaml: VLLM_USE_V1: the value must be a string or an integer" in bad.stderr


def test_docker_stop_during_the_run_reaches_the_orchestrator(box):
    env, state, log = box
    proc = subprocess.Popen(["bash", str(ENTRYPOINT)], env={**env, "MODEL": "m", "FAKE_SLEEP": "30"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while "started" not in calls(log):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 143
    assert calls(log)[-1] == "terminated"
    assert not any(c.startswith("vllm") for c in calls(log))


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, "--failure-threshold", "style", str(REPO / "Dockerfile")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_builds_on_vllm_keeps_state_in_a_volume_and_uses_the_entrypoint():
    text = (REPO / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=vllm/vllm-openai:v0.10.2\nFROM ${BASE_IMAGE}\n" in text
    assert 'VOLUME ["/var/lib/orchestrator"]' in text and "ORCHESTRATOR_STATE=/var/lib/orchestrator" in text
    assert 'ENTRYPOINT ["/usr/local/bin/orchestrator-entrypoint"]' in text
    for copied in ("orchestrator/", "kernels/", "engine/", "optimizations/", "docker/"):
        assert f"COPY {copied} {copied}" in text
