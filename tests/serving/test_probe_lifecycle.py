"""The serving probe's handling of servers that misbehave: it always fails clearly and never leaves
a process behind."""
from __future__ import annotations

import signal
import subprocess
import time

import httpx
import psutil

from serving_support import PY, REPO, alive_with, env, last_json, run_probe, wait_for, write_config


def _start_probe(args: list[str], **extra_env: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "orchestrator.probes.serving", *args], cwd=REPO, env=env(**extra_env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_server_never_healthy_fails_and_stops_its_whole_group(tmp_path, marker):
    """A real HTTP server that answers /health with 404, with a child of its own in its group."""
    folder = tmp_path / marker
    folder.mkdir()
    cmd = (f"sh -c '{PY} -c \"import time; time.sleep(600)\" {marker} & "
           f"exec {PY} -m http.server {{port}} --bind 127.0.0.1 --directory {folder}'")
    start = time.monotonic()
    probe = _start_probe(["--server-cmd", cmd, "--health-timeout", "3", "--num-prompts", "1"])
    try:
        wait_for(lambda: len(alive_with(marker)) == 2, 30, "the server and its child")
        stdout, _ = probe.communicate(timeout=60)
    finally:
        probe.kill()
    assert probe.returncode == 1
    assert "did not answer /health with 200 within 3 s" in last_json(stdout)["error"]
    assert time.monotonic() - start < 30
    assert alive_with(marker) == []


def test_server_that_exits_before_healthy_reports_code_and_output(marker):
    cmd = f"{PY} -c \"print('{marker} cannot start'); raise SystemExit(3)\" {{port}}"
    rc, out, _ = run_probe("--server-cmd", cmd, "--health-timeout", "30")
    assert rc == 1
    assert "exited with code 3" in out["error"]
    assert f"{marker} cannot start" in out["error"]


def test_missing_server_command_is_a_clear_error():
    rc, out, _ = run_probe("--server-cmd", "/nonexistent/serve {port}")
    assert rc == 1
    assert "cannot start server command /nonexistent/serve" in out["error"]


def test_no_target_and_no_server_is_a_clear_error():
    rc, out, _ = run_probe(ORCHESTRATOR_TARGET_ROOT="")
    assert rc == 1
    assert "ORCHESTRATOR_TARGET_ROOT" in out["error"]


def test_sigterm_to_the_probe_mid_run_stops_the_engine_server(tmp_path):
    root = tmp_path / "workspace"
    write_config(root)
    probe = _start_probe(["--num-prompts", "2000", "--output-len", "64", "--health-timeout", "120"],
                         ORCHESTRATOR_TARGET_ROOT=str(root))
    try:
        server = wait_for(lambda: alive_with(str(root)), 30, "the server to start")[0]
        port = wait_for(lambda: [c.laddr.port for c in server.net_connections("tcp")
                                 if c.status == psutil.CONN_LISTEN], 120, "the server to listen")[0]
        wait_for(lambda: 'num_requests_running{model_name="tiny"} 0.0' not in _metrics(port), 60,
                 "the benchmark to be running")
        probe.send_signal(signal.SIGTERM)
        stdout, _ = probe.communicate(timeout=60)
    finally:
        probe.kill()
    assert probe.returncode == 143
    assert "terminated by SIGTERM" in last_json(stdout)["error"]
    assert alive_with(str(root)) == []


def _metrics(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics").text
    except httpx.TransportError:
        return 'num_requests_running{model_name="tiny"} 0.0'


def test_sigkill_to_the_probe_still_ends_the_server(tmp_path, marker):
    folder = tmp_path / marker
    folder.mkdir()
    cmd = f"{PY} -m http.server {{port}} --bind 127.0.0.1 --directory {folder}"
    probe = _start_probe(["--server-cmd", cmd, "--health-timeout", "120"])
    try:
        wait_for(lambda: alive_with(marker), 30, "the server to start")
        probe.kill()
        probe.wait(10)
    finally:
        probe.kill()
        probe.communicate()
    wait_for(lambda: not alive_with(marker), 10, "the orphaned server to end")
