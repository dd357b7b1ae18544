"""Symlinks, folders and modes changed by command steps: recorded, switched by the measurement arms, restored
exactly by rollback; a symlink a step points outside the target root fails the step."""
from __future__ import annotations

import os

from core_project import add_plugin, images, make_project, set_probes

# score = 100 x the number in current/speed.txt, read through the symlink `current`
SPEED = ["python", "-c", "import json, os, pathlib; root = pathlib.Path(os.environ['ORCHESTRATOR_TARGET_ROOT']); "
         "print(json.dumps({'score': 100 * int((root / 'current' / 'speed.txt').read_text())}))"]
CORRECT = ["python", "-c", "print('{\"passed\": true}')"]


def layout(project) -> None:
    """v1 and v2 of an app, `current` pointing at v1; an empty folder; an executable script."""
    for version, speed in (("v1", "1"), ("v2", "9")):
        (project.target / version).mkdir()
        (project.target / version / "speed.txt").write_text(speed)
    (project.target / "current").symlink_to("v1")
    (project.target / "spool").mkdir()
    (project.target / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(project.target / "run.sh", 0o755)
    os.chmod(project.target / "v2", 0o750)


def flip_project(tmp_path, command: str, plugin_id: str = "flip"):
    project = make_project(tmp_path / "p", plugins=[], policy={"interleave": True, "min_pairs": 2, "max_pairs": 3,
                                                                "repeats": 2})
    set_probes(project, [{"name": "correct", "role": "correctness", "command": CORRECT},
                         {"name": "speed", "role": "throughput", "command": SPEED, "objective": "score"}])
    layout(project)
    # v2 is nine times as fast: a gain the plugin says it expects (an implausible one is vetoed otherwise)
    add_plugin(project, {"id": plugin_id, "apply": [{"command": {"run": ["sh", "-c", command]}}],
                         "accept": {"implausible_factor": 10}})
    return project


def test_a_symlink_flip_is_measured_kept_and_rolled_back_exactly(tmp_path):
    # the flip also removes an empty folder, makes a new one, changes a mode and the folder mode of v2
    project = flip_project(tmp_path, "ln -sfn v2 current && rmdir spool && mkdir -p cache/deep && "
                                     "chmod 600 run.sh && chmod 700 v2")
    original = images(project.target)
    project.cli("run", check=0)
    step = project.status()["steps"][0]
    assert (step["outcome"], step["reason"]) == ("kept", None), step
    assert step["gain"] > 5  # the arms switched the symlink: 100 against 900
    log = [r["value"] for r in project.db().execute(
        "SELECT value FROM measurements WHERE role = 'throughput' AND step_id IS NOT NULL ORDER BY id")]
    assert sorted(set(log)) == [100.0, 900.0]
    now = images(project.target)
    assert now["current"] == ("link", "v2") and "spool" not in now and now["cache/deep"][0] == "dir"
    assert now["run.sh"][2] == 0o600 and now["v2"] == ("dir", 0o700)
    out = project.cli("rollback", "--all", check=0).stdout
    assert "rolled_back flip" in out
    assert images(project.target) == original


def test_a_rolled_back_attempt_restores_links_folders_and_modes(tmp_path):
    project = flip_project(tmp_path, "rm current && ln -s v1/speed.txt current && rmdir spool && chmod 700 run.sh "
                                     "&& mkdir new && exit 3")
    original = images(project.target)
    project.cli("run", check=0)
    step = project.status()["steps"][0]
    assert (step["outcome"], step["reason"]) == ("rolled_back", "apply_failed")
    assert images(project.target) == original


def test_a_symlink_out_of_the_root_fails_the_step(tmp_path):
    project = flip_project(tmp_path, "ln -s ../../outside leak && ln -sfn /etc current")
    original = images(project.target)
    project.cli("run", check=0)
    step = project.status()["steps"][0]
    assert (step["outcome"], step["reason"]) == ("rolled_back", "apply_failed")
    assert "leads outside the target root" in step["detail"]
    assert images(project.target) == original
