"""Two configs with different state folders on one target, or on targets one of which lies inside the other: the
second command is refused, naming the holder, whatever its environment. No lock or holder file is opened through
a symlink, nor has its mode widened."""
from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import yaml

from core_project import REPO, make_project, tree


def wait_for(path: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _cli(project, config: Path, *args: str, env: dict | None = None):
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "400", **(env or {})}
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "--config", str(config)],
                          cwd=project.path, env=env, capture_output=True, text=True, timeout=120)


def blocking_probe(project) -> None:
    """speedup's correctness probe writes `probing`, then waits for `go-on`."""
    (project.path / "probes" / "correct.py").write_text(
        "import os, time\nfrom pathlib import Path\n"
        "if os.environ['ORCHESTRATOR_PLUGIN'] == 'speedup':\n"
        "    Path('probing').write_text('')\n"
        "    while not Path('go-on').exists():\n"
        "        time.sleep(0.05)\n"
        "print('{\"passed\": true}')\n")


def other_project(project, name: str, root: Path) -> Path:
    """A config beside `project`'s folder with its own state and plugin folders, whose target root is `root`."""
    config = yaml.safe_load(project.config.read_text())
    base = project.path.parent.parent
    (base / f"plugins-{name}").mkdir()
    config.update(target={"kind": "files", "root": str(root)}, state=f"state-{name}", plugins=f"plugins-{name}")
    for probe in config["probes"]:
        probe["command"] = ["python", str(project.path / probe["command"][1])]
    path = base / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_root_equal_to_inside_or_containing_a_running_ones_is_refused_whatever_the_environment(tmp_path):
    project = make_project(tmp_path / "outer" / "p", plugins=["speedup"])
    blocking_probe(project)
    os.symlink(project.target, tmp_path / "target-link")  # the same folder: the lock goes by the folder itself
    overlapping = {"same": tmp_path / "target-link", "inside": project.target / "conf", "containing": tmp_path / "outer"}
    configs = {name: other_project(project, name, root) for name, root in overlapping.items()}
    first = project.spawn("run")
    try:
        wait_for(project.path / "probing")  # the first run has applied speedup and is probing it
        during = tree(tmp_path / "outer")
        for name, args in [("same", ["run"]), ("same", ["rollback", "--all"]), ("inside", ["run"]),
                           ("containing", ["run"])]:
            env = {"TMPDIR": str(tmp_path / f"tmp-{name}"), "ORCHESTRATOR_LOCK_DIR": str(tmp_path / f"locks-{name}")}
            os.makedirs(env["TMPDIR"], exist_ok=True)
            proc = _cli(project, configs[name], *args, env=env)
            assert proc.returncode == 1, (name, proc.stdout + proc.stderr)
            message = " ".join(proc.stderr.split())
            assert "Traceback" not in proc.stderr
            what = "is in use by" if name == "same" else f"overlaps the target root {project.target.resolve()} of"
            assert f"the target root {overlapping[name].resolve()} {what} another orchestrator command" in message, \
                (name, message)
            assert f"pid {first.pid}" in message and f"state folder {project.state}" in message, (name, message)
            assert re.search(r"command `[^`]*orchestrator\.cli run --config [^`]*orchestrator\.yaml`", message)
            assert tree(tmp_path / "outer") == during  # the refused command changed nothing
            assert not (tmp_path / f"state-{name}" / "orchestrator.db").exists()
    finally:
        (project.path / "go-on").write_text("")
        assert first.wait(timeout=120) == 0, first.stdout.read()
    assert project.outcomes()["speedup"] == ("kept", None)
    assert _cli(project, configs["same"], "run").returncode == 0  # once the first has finished


LAUNCH = "import os, sys; sys.stdin.readline(); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"


def test_links_planted_where_lock_notes_are_written_are_not_followed(tmp_path):
    """A holder note is written under a name that holds the command's pid; links to a file of the user's, planted
    under those names in the state folder and in a folder every user can write to, change nothing of it."""
    project = make_project(tmp_path / "p", plugins=["speedup"])
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"the user's own file\n")
    victim.chmod(0o600)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    project.state.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "ORCHESTRATOR_LOCK_DIR": str(shared), "TMPDIR": str(shared)}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "-m", "orchestrator.cli", "run", "--config",
                             str(project.config)], cwd=project.path, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    key = hashlib.sha256(os.path.realpath(project.target).encode()).hexdigest()[:32]
    for folder, name in ((project.state, "orchestrator.lock.holder"), (shared, f"root-{key}.lock.holder")):
        os.symlink(victim, folder / f"{name}.{proc.pid}")
        os.symlink(victim, folder / name)
    out, _ = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0, out
    assert victim.read_bytes() == b"the user's own file\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert project.outcomes()["speedup"] == ("kept", None)
    lock = project.state / "orchestrator.lock"
    assert not stat.S_IMODE(lock.stat().st_mode) & (stat.S_IWGRP | stat.S_IWOTH)  # nobody else may write it


def test_a_link_planted_as_the_state_lock_is_refused_naming_it(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup"])
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"the user's own file\n")
    victim.chmod(0o600)
    project.state.mkdir()
    os.symlink(victim, project.state / "orchestrator.lock")
    before = tree(tmp_path)
    proc = project.cli("run")
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert f"{project.state / 'orchestrator.lock'} is a symlink" in message, message
    assert tree(tmp_path) == before and stat.S_IMODE(victim.stat().st_mode) == 0o600


def test_the_state_lock_names_its_holder_too(tmp_path):
    project = make_project(tmp_path, plugins=["speedup"])
    (project.path / "probes" / "correct.py").write_text(
        "import time\nfrom pathlib import Path\nPath('probing').write_text('')\n"
        "while not Path('go-on').exists():\n    time.sleep(0.05)\nprint('{\"passed\": true}')\n")
    first = project.spawn("run")
    try:
        wait_for(project.path / "probing")
        proc = _cli(project, project.config, "run")
        message = " ".join(proc.stderr.split())
        assert proc.returncode == 1 and "a run is in progress" in message and f"pid {first.pid}" in message
    finally:
        (project.path / "go-on").write_text("")
        first.wait(timeout=120)
