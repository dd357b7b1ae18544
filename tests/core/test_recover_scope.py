"""`recover` after a kill during a command step puts back only what the run changed: what anyone else wrote
stays (named), a path the run changed that someone changed again is refused by name unless --force, also through
the recovery at the start of `run` and `rollback`; a command's processes do not outlive the run, and a slow write
of the run's own is known for its own."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from core_project import REPO, add_plugin, ended, make_project, tree
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
    assert ended(project, 10)  # what happens from now on is not the run's doing
    return project, original, step_pid


def test_a_file_created_after_the_run_stopped_is_kept(killed):
    project, original, step_pid = killed
    (project.target / "notes.txt").write_text("mine\n")
    (project.target / "conf" / "mine").mkdir()
    out = project.cli("recover", check=0).stdout
    assert "rolled_back kill-apply" in out and "notes.txt (not changed by kill-apply)" in out
    assert gone(step_pid)
    assert tree(project.target) == {**original, "notes.txt": b"mine\n", "conf/mine": None}


@pytest.mark.parametrize("command", [("recover",), ("run",), ("rollback", "--all")])
def test_a_recorded_path_changed_after_the_run_stopped_is_refused_by_name(killed, command):
    project, original, _ = killed
    (project.target / "created-by-command.txt").write_text("edited by hand\n")  # what the command step wrote
    (project.target / "app.txt").write_text("SPEED = 8\n")  # the plugin's own file, edited again
    before = tree(project.target)
    proc = project.cli(*command, check=1)
    message = " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr
    assert "recovery refused, nothing was changed" in message
    assert f"{project.target / 'created-by-command.txt'} (kill-apply, step 1)" in message
    assert f"{project.target / 'app.txt'} (kill-apply, step 1)" in message
    assert "orchestrator recover --force" in message
    assert tree(project.target) == before
    assert project.status()["steps"][0]["state"] == "applying"  # still to be recovered


def test_force_puts_back_what_was_refused(killed):
    project, original, _ = killed
    (project.target / "created-by-command.txt").write_text("edited by hand\n")
    (project.target / "notes.txt").write_text("mine\n")
    out = project.cli("recover", "--force", check=0).stdout
    assert "rolled_back kill-apply" in out
    assert tree(project.target) == {**original, "notes.txt": b"mine\n"}
    assert project.outcomes() == {"kill-apply": ("rolled_back", "interrupted")}


def crash(project) -> None:
    """A run SIGKILLed while kill-apply's command sleeps (app.txt edited, created-by-command.txt written)."""
    proc = project.spawn("run")
    wait_for(project.path / "marker-apply", proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("command", [("recover",), ("rollback", "--all")])
def test_edits_made_right_after_a_crash_are_kept_and_named(tmp_path, command):
    project = make_project(tmp_path / "p", plugins=[], extra=["kill-apply"])
    original = tree(project.target)
    crash(project)
    ended(project, 0.6)  # the run's processes end with it; either way, well within a second of the kill
    (project.target / "notes.txt").write_text("mine\n")
    with open(project.target / "conf" / "serve.yaml", "a") as f:
        f.write("extra: 1\n")
    (project.target / "hotfix").mkdir()
    (project.target / "hotfix" / "fix.py").write_text("FIX = 1\n")
    out = " ".join(project.cli(*command, check=0).stdout.split())
    assert tree(project.target) == {**original, "notes.txt": b"mine\n", "hotfix": None, "hotfix/fix.py": b"FIX = 1\n",
                                    "conf/serve.yaml": original["conf/serve.yaml"] + b"extra: 1\n"}
    for name in ("notes.txt", "conf/serve.yaml", "hotfix/fix.py"):
        assert str(project.target / name) in out, out
    assert project.outcomes() == {"kill-apply": ("rolled_back", "interrupted")}


def test_without_a_heartbeat_file_a_hand_edit_is_not_reverted(tmp_path):
    """An older state folder, or a backup that skips empty files, has no heartbeat file."""
    project = make_project(tmp_path / "p", plugins=[], extra=["kill-apply"])
    original = tree(project.target)
    crash(project)
    ended(project, 1)
    time.sleep(1.2)
    (project.state / "heartbeat").unlink(missing_ok=True)
    with open(project.target / "blob.bin", "ab") as f:
        f.write(b"by hand\n")
    out = " ".join(project.cli("recover", check=0).stdout.split())
    assert tree(project.target) == {**original, "blob.bin": original["blob.bin"] + b"by hand\n"}
    assert str(project.target / "blob.bin") in out


# Writes a file every 20 ms in the target, and so does a daemon it double-forks into a session of its own.
OUTLIVES = """\
import os, pathlib, time
marker = pathlib.Path(os.environ["TEST_MARKER_DIR"])
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        pathlib.Path("daemon").mkdir()
        i = 0
        while True:
            pathlib.Path(f"daemon/{i}.txt").write_text(str(i))
            if i == 0:
                (marker / "daemon.pid").write_text(str(os.getpid()))
            i += 1
            time.sleep(0.02)
    os._exit(0)
i = 0
while True:
    pathlib.Path(f"main-{i}.txt").write_text(str(i))
    if i == 0:
        (marker / "main.pid").write_text(str(os.getpid()))
    i += 1
    time.sleep(0.02)
"""


def outliving(tmp_path):
    """A run SIGKILLed while a command it started writes into the target: (project, original, the writers' pids)."""
    project = make_project(tmp_path / "p", plugins=[])
    add_plugin(project, {"id": "outlives", "apply": [{"command": {"run": ["python", "-c", OUTLIVES], "timeout": 300}}]})
    original = tree(project.target)
    proc = project.spawn("run")
    pids = [int(wait_for(project.path / name, proc)) for name in ("main.pid", "daemon.pid")]
    time.sleep(0.2)
    return project, original, pids, proc


def test_a_command_that_would_outlive_the_run_is_ended_and_leaves_no_file(tmp_path):
    project, original, pids, proc = outliving(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1.5)  # it would go on writing meanwhile
    out = project.cli("recover", check=0).stdout
    assert "rolled_back outlives" in out
    assert all(gone(pid) for pid in pids)
    assert tree(project.target) == original


def test_a_command_whose_keeper_was_killed_too_is_ended_and_its_changes_refused_by_name(tmp_path):
    """Nothing recorded when the command's processes ended: none of its changes can be told from later ones."""
    project, original, pids, proc = outliving(tmp_path)
    keeper = psutil.Process(pids[0]).parent()
    keeper.kill()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.3)  # the command goes on writing
    refused = project.cli("recover", check=1)
    message = " ".join(refused.stderr.split())
    assert "Traceback" not in refused.stderr and "recovery refused, nothing was changed" in message
    assert all(gone(pid) for pid in pids)
    assert str(project.target / "main-0.txt") in message and str(project.target / "daemon") in message
    assert "orchestrator recover --force" in message
    before = tree(project.target)
    project.cli("recover", check=1)
    assert tree(project.target) == before
    project.cli("recover", "--force", check=0)
    assert tree(project.target) == original
    assert project.outcomes() == {"outlives": ("rolled_back", "interrupted")}


@pytest.mark.parametrize("when", ["half", "written"])
def test_a_slow_write_of_the_run_is_known_for_its_own(tmp_path, when):
    """The run writes a large file on a slow disk (two halves 1.5 s apart, then it hangs) and is killed: half-way
    through, or once every byte is written but the file not yet truncated; no one else touched anything."""
    project = make_project(tmp_path / "p", plugins=[])
    (project.target / "big.bin").write_bytes(bytes(range(256)) * 4096)
    add_plugin(project, {"id": "large", "apply": [{"deploy": {"src": "files/big.bin", "dest": "big.bin"}}]})
    (project.path / "plugins" / "large" / "files").mkdir()
    (project.path / "plugins" / "large" / "files" / "big.bin").write_bytes(bytes(range(255, -1, -1)) * 2500)
    original = tree(project.target)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TEST_MARKER_DIR": str(project.path)}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "fault_run.py"), "slow", "1", "run",
                             "--config", str(project.config)], cwd=project.path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_for(project.path / f"marker-slow-{when}", proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (project.target / "big.bin").read_bytes() != original["big.bin"]
    out = project.cli("recover", check=0).stdout
    assert "rolled_back large" in out
    assert tree(project.target) == original


def test_a_folder_a_killed_command_swapped_for_a_link_out_of_the_target_is_put_back_whole(tmp_path):
    """The command moved conf/ out of the target and left a link to it: its files, read through the link, still
    hold their pre-images, yet the target has none of them. Recovery puts the folder back with its files and
    writes nothing outside."""
    project = make_project(tmp_path / "p", plugins=[])
    outside = tmp_path / "outside"
    add_plugin(project, {"id": "swap", "apply": [{"command": {"timeout": 300, "run": [
        sys.executable, "-c",
        "import os, pathlib, shutil, time\n"
        f"shutil.move('conf', {str(outside / 'conf')!r})\n"
        f"os.symlink({str(outside / 'conf')!r}, 'conf')\n"
        "pathlib.Path(os.environ['TEST_MARKER_DIR'], 'marker-apply').write_text(str(os.getpid()))\n"
        "time.sleep(120)\n"]}}]})
    outside.mkdir()
    original = tree(project.target)
    proc = project.spawn("run")
    wait_for(project.path / "marker-apply", proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ended(project, 10)
    moved = tree(outside)
    project.cli("recover", check=0)
    assert tree(project.target) == original
    assert tree(outside) == moved
