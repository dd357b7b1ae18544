"""kill -9 of a real `orchestrator run` during apply and during a probe; recovery; the state lock."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil

from core_project import make_project, set_probes, tree


def wait_for(path: Path, proc, timeout: float = 60) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def gone(pid: int, timeout: float = 5) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_kill_during_apply_then_recover(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup"], extra=["kill-apply"])
    proc = project.spawn("run", "--only", "kill-apply")
    step_pid = int(wait_for(project.path / "marker-apply", proc))
    assert (project.target / "app.txt").read_text().startswith("SPEED = 7")  # the edit is on disk mid-apply
    assert (project.target / "created-by-command.txt").exists()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert gone(step_pid)  # in a session of its own, the command still ends with the orchestrator (its keeper)
    out = project.cli("recover", check=0).stdout
    assert "kill-apply" in out and "interrupted" in out
    fresh = make_project(tmp_path / "fresh", plugins=[])
    assert tree(project.target) == tree(fresh.target)
    data = project.status()
    assert data["run"]["status"] == "interrupted"
    assert [(s["plugin"], s["outcome"], s["reason"]) for s in data["steps"]] == [
        ("kill-apply", "rolled_back", "interrupted")]
    assert project.cli("recover", check=0).stdout.strip() == "nothing to recover"


def test_kill_during_probe_lock_and_status_while_running(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup"], extra=["kill-probe"], speed_timeout=300)
    original = tree(project.target)
    proc = project.spawn("run")
    probe_pid = int(wait_for(project.path / "marker-probe", proc))
    assert (project.target / "sub" / "x.txt").exists()

    second = project.cli("run", check=1)
    assert "in progress" in second.stderr
    live = project.status()
    assert live["run"]["status"] == "running"
    assert {s["plugin"]: s["state"] for s in live["steps"]}["kill-probe"] == "measuring"

    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # the next run recovers first, then stages normally (kill-probe hangs again, so run only speedup)
    (project.path / "marker-probe").unlink()
    run = project.cli("run", "--only", "speedup", check=0)
    assert "recovered: kill-probe" in run.stdout
    assert gone(probe_pid)
    interrupted = project.status("--run", "1")
    assert interrupted["run"]["status"] == "interrupted"
    assert {s["plugin"]: (s["outcome"], s["reason"]) for s in interrupted["steps"]}["kill-probe"] == (
        "rolled_back", "interrupted")
    expected = dict(original)
    expected["app.txt"] = original["app.txt"].replace(b"SPEED = 1", b"SPEED = 2")
    assert tree(project.target) == expected
    project.cli("rollback", "--all", check=0)
    assert tree(project.target) == original


def test_sigterm_rolls_back_and_records_interrupted(tmp_path):
    project = make_project(tmp_path / "p", plugins=[], extra=["kill-probe"], speed_timeout=300)
    original = tree(project.target)
    proc = project.spawn("run")
    probe_pid = int(wait_for(project.path / "marker-probe", proc))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "interrupted" in out
    assert gone(probe_pid)
    assert tree(project.target) == original
    data = project.status()
    assert data["run"]["status"] == "interrupted"
    assert [(s["outcome"], s["reason"]) for s in data["steps"]] == [("rolled_back", "interrupted")]


def test_recover_says_what_it_ended_when_no_step_was_open(tmp_path):
    """Killed during the baseline's correctness probe: there is no step to roll back, but a probe to end and a run
    to close."""
    project = make_project(tmp_path / "p", plugins=["speedup"])
    set_probes(project, [{"name": "correct", "role": "correctness", "timeout": 300, "command": [
        "python", "-c", "import os, pathlib, time; "
        "pathlib.Path(os.environ['TEST_MARKER_DIR'], 'marker-baseline').write_text(str(os.getpid())); time.sleep(120)"]}])
    proc = project.spawn("run")
    probe_pid = int(wait_for(project.path / "marker-baseline", proc))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    out = " ".join(project.cli("recover", check=0).stdout.split())
    assert gone(probe_pid)
    assert "nothing to recover" not in out
    assert f"ended probe correct (pid {probe_pid}) of run 1" in out, out
    assert "run 1 recorded as interrupted" in out, out
    assert project.status()["run"]["status"] == "interrupted"
    assert project.cli("recover", check=0).stdout.strip() == "nothing to recover"
