"""LiveServer: a server in its own process group, judged healthy by GET /health, always stopped
(SIGTERM, then SIGKILL of the group), never waited on past its timeouts."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from orchestrator.probes.live_server import LiveServer, ServerFailed
from serving_support import PY, alive_with

# answers /health with 200 (other paths: the argv it was given, as JSON); with "stubborn" in its argv
# it ignores SIGTERM and so does a child it leaves in its group
HEALTHY = """
import http.server, json, signal, subprocess, sys, time
if "stubborn" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "time.sleep(600)", *sys.argv[2:]])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"" if self.path == "/health" else json.dumps(sys.argv).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_healthy_server_is_stopped_with_sigterm_and_its_temporary_log_removed(marker):
    server = LiveServer([PY, "-c", HEALTHY, "{port}", marker, '{"json": {"kept": "as is"}}'])
    with server:
        server.wait_healthy(30)
        argv = httpx.get(f"{server.url}/argv").json()
        assert argv[2:] == [marker, '{"json": {"kept": "as is"}}']  # only {host} and {port} are filled in
        log = server.log_path
        assert log.exists() and alive_with(marker)
    assert server.stopped_by == "SIGTERM" and server.leftover == []
    assert alive_with(marker) == [] and not log.exists()


def test_a_group_that_ignores_sigterm_is_killed_after_the_grace_period(marker, tmp_path):
    server = LiveServer([PY, "-c", HEALTHY, "{port}", "stubborn", marker], stop_timeout=1.0, log_dir=tmp_path,
                        log_label="run3-plugin [x=1]-greedy")
    server.start().wait_healthy(30)
    assert len(alive_with(marker)) == 2
    start = time.monotonic()
    server.stop()
    assert 1.0 <= time.monotonic() - start < 15
    assert server.stopped_by == "SIGKILL" and server.leftover == [] and alive_with(marker) == []
    assert server.log_path.parent == tmp_path and server.log_path.name.startswith("run3-plugin_x=1_-greedy-")
    assert server.log_path.read_text().startswith(f"$ {PY} -c")  # a kept log says what ran
    server.stop()  # idempotent


def test_never_healthy_is_a_timeout_within_its_deadline(marker):
    server = LiveServer([PY, "-c", f"import time; print('{marker} starting', flush=True); time.sleep(600)", "{port}"])
    with server:
        start = time.monotonic()
        with pytest.raises(ServerFailed) as info:
            server.wait_healthy(2)
        assert time.monotonic() - start < 8
    assert info.value.reason == "timeout"
    assert "did not answer /health with 200 within 2 s" in str(info.value)
    assert f"{marker} starting" in str(info.value)  # the log's tail
    assert alive_with(marker) == []


def test_a_server_that_exits_is_a_crash_with_its_output(marker):
    with LiveServer([PY, "-c", f"import sys; print('{marker}: bad option'); sys.exit(2)", "{port}"]) as server:
        with pytest.raises(ServerFailed) as info:
            server.wait_healthy(60)
    assert info.value.reason == "crashed"
    assert "exited with code 2" in str(info.value) and f"{marker}: bad option" in str(info.value)
    assert server.stopped_by == "exited"


def test_a_missing_executable_is_a_crash_naming_it():
    with pytest.raises(ServerFailed) as info:
        LiveServer(["/nonexistent/vllm", "serve", "--port", "{port}"]).start()
    assert info.value.reason == "crashed" and "cannot start server command /nonexistent/vllm" in str(info.value)


def test_an_exception_inside_the_block_still_stops_the_server(marker):
    with pytest.raises(RuntimeError):
        with LiveServer([PY, "-c", HEALTHY, "{port}", marker]) as server:
            server.wait_healthy(30)
            raise RuntimeError("the caller failed")
    assert alive_with(marker) == []


def test_probe_reports_a_start_up_timeout_as_its_reason(marker):
    """The serving probe's JSON says `reason: timeout`, which the probe runner turns into the outcome."""
    from orchestrator.probes.runner import ProcessResult, judge_output
    from serving_support import run_probe

    cmd = f"{PY} -c \"import time; time.sleep(600)\" {{port}} {marker}"
    rc, out, _ = run_probe("--server-cmd", cmd, "--health-timeout", "2")
    assert rc == 1 and out["reason"] == "timeout"
    def finished(result: dict) -> ProcessResult:
        return ProcessResult(1, False, 1.0, json.dumps(result), "", result=result)

    judged = judge_output("throughput", "score", finished(out), 60)
    assert judged.reason == "timeout" and "did not answer /health" in judged.message
    assert judge_output("correctness", None, finished({"passed": False, "reason": "crashed"}), 60).reason == "crashed"
    other = judge_output("correctness", None, finished({"passed": False, "reason": "kept"}), 60)
    assert other.reason == "incorrect"  # only the reasons a probe may report are taken from it
    assert alive_with(marker) == []
