"""Two configs with different state folders on one target: the second command is refused, naming the holder."""
from __future__ import annotations

import os
import re
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


def second_config(project, name: str = "second.yaml") -> Path:
    """The same target folder (through a symlink, to show the lock goes by real path), another state folder."""
    os.symlink(project.target, project.path / "target-link")
    config = yaml.safe_load(project.config.read_text())
    config["target"]["root"] = "target-link"
    config["state"] = "state-two"
    path = project.path / name
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_second_state_folder_on_the_same_target_is_refused_naming_the_holder(tmp_path):
    project = make_project(tmp_path, plugins=["speedup"])
    (project.path / "probes" / "correct.py").write_text(
        "import os, time\nfrom pathlib import Path\n"
        "if os.environ['ORCHESTRATOR_PLUGIN'] == 'speedup':\n"
        "    Path('probing').write_text('')\n"
        "    while not Path('go-on').exists():\n"
        "        time.sleep(0.05)\n"
        "print('{\"passed\": true}')\n")
    other = second_config(project)
    first = project.spawn("run")
    try:
        wait_for(project.path / "probing")  # the first run has applied speedup and is probing it
        during = tree(project.target)
        for args in (["run"], ["rollback", "--all"]):
            proc = _cli(project, other, *args)
            assert proc.returncode == 1, proc.stdout + proc.stderr
            message = " ".join(proc.stderr.split())
            assert f"the target root {project.target.resolve()} is in use" in message
            assert f"pid {first.pid}" in message and f"state folder {project.state}" in message
            assert re.search(r"command `[^`]*orchestrator\.cli run --config [^`]*orchestrator\.yaml`", message)
            assert tree(project.target) == during  # the refused command changed nothing
        assert not (project.path / "state-two" / "orchestrator.db").exists()
    finally:
        (project.path / "go-on").write_text("")
        assert first.wait(timeout=120) == 0, first.stdout.read()
    assert project.outcomes()["speedup"] == ("kept", None)
    # once the first has finished, the second state folder may use the target
    assert _cli(project, other, "run").returncode == 0


def _cli(project, config: Path, *args: str):
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "--config", str(config)],
                          cwd=project.path, env=env, capture_output=True, text=True, timeout=120)


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
