"""`recover` after a kill during a command step puts back only what the run changed: a file created after the
run stopped stays, and a recorded path changed after it stopped is refused by name unless --force, also through
the recovery at the start of `run` and `rollback`."""
from __future__ import annotations

import os
import signal
import time

import pytest

from core_project import make_project, tree
from orchestrator.recovery import SETTLE
from test_crash import gone, wait_for


@pytest.fixture
def killed(tmp_path):
    """kill-apply edited app.txt, then its command created a file and sleeps; the run is killed, time passes."""
    project = make_project(tmp_path / "p", plugins=[], extra=["kill-apply"])
    original = tree(project.target)
    proc = project.spawn("run")
    step_pid = int(wait_for(project.path / "marker-apply", proc))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(SETTLE + 0.5)  # what happens from now on is not the run's doing
    return project, original, step_pid


def test_a_file_created_after_the_run_stopped_is_kept(killed):
    project, original, step_pid = killed
    (project.target / "notes.txt").write_text("mine\n")
    (project.target / "conf" / "mine").mkdir()
    out = project.cli("recover", check=0).stdout
    assert "rolled_back kill-apply" in out and "notes.txt (new since the run stopped)" in out
    assert gone(step_pid)
    assert tree(project.target) == {**original, "notes.txt": b"mine\n", "conf/mine": None}


@pytest.mark.parametrize("command", [("recover",), ("run",), ("rollback", "--all")])
def test_a_recorded_path_changed_after_the_run_stopped_is_refused_by_name(killed, command):
    project, original, _ = killed
    (project.target / "blob.bin").write_bytes(b"edited by hand\n")  # in the root the command step snapshotted
    (project.target / "app.txt").write_text("SPEED = 8\n")  # the plugin's own file, edited again
    before = tree(project.target)
    proc = project.cli(*command, check=1)
    message = " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr
    assert "recovery refused, nothing was changed" in message
    assert f"{project.target / 'blob.bin'} (kill-apply, step 1)" in message
    assert f"{project.target / 'app.txt'} (kill-apply, step 1)" in message
    assert "orchestrator recover --force" in message
    assert tree(project.target) == before
    assert project.status()["steps"][0]["state"] == "applying"  # still to be recovered


def test_force_puts_back_what_was_refused(killed):
    project, original, _ = killed
    (project.target / "blob.bin").write_bytes(b"edited by hand\n")
    (project.target / "notes.txt").write_text("mine\n")
    out = project.cli("recover", "--force", check=0).stdout
    assert "rolled_back kill-apply" in out
    assert tree(project.target) == {**original, "notes.txt": b"mine\n"}
    assert project.outcomes() == {"kill-apply": ("rolled_back", "interrupted")}
