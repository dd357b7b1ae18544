"""The history names files by root and relative path; where a root is comes from the config. A copied or moved
project acts on its own target, and a config pointing a root elsewhere than the history's files is refused."""
from __future__ import annotations

import shutil
import sqlite3

import yaml

from core_project import Project, make_project, tree
from test_legacy_db import DEPLOYED, LEGACY


def kept_project(tmp_path) -> tuple[Project, dict]:
    project = make_project(tmp_path / "original", plugins=["speedup", "no-gain"],
                           policy={"interleave": False, "rule": "first", "repeats": 1})
    original = tree(project.target)
    project.cli("run", "--only", "speedup", check=0)
    assert project.outcomes()["speedup"] == ("kept", None)
    return project, original


def test_a_copied_project_rolls_back_its_own_target(tmp_path):
    project, original = kept_project(tmp_path)
    kept = tree(project.target)
    copy = Project(tmp_path / "copy")
    shutil.copytree(project.path, copy.path)
    out = copy.cli("rollback", "--all", check=0).stdout
    assert "rolled_back speedup" in out
    assert tree(copy.target) == original
    assert tree(project.target) == kept  # the original project is untouched...
    project.cli("rollback", "--all", check=0)  # ...and still rolls back its own
    assert tree(project.target) == original
    assert [r[0] for r in sqlite3.connect(copy.state / "orchestrator.db").execute("SELECT location FROM roots")] == [
        "../target"]


def test_a_config_pointing_a_root_elsewhere_is_refused_naming_both(tmp_path):
    project, original = kept_project(tmp_path)
    copy = Project(tmp_path / "copy")
    shutil.copytree(project.path, copy.path)
    config = yaml.safe_load(copy.config.read_text())
    config["target"]["root"] = str(project.target)  # the copy's config now names the original's target
    copy.config.write_text(yaml.safe_dump(config))
    before = (tree(project.path), tree(copy.path))
    for command in (("rollback", "--all"), ("run",), ("recover",)):
        proc = copy.cli(*command, check=1)
        message = " ".join(proc.stderr.split())
        assert "Traceback" not in proc.stderr
        assert f"root 'target' is {project.target} in the config, but the history's files are in {copy.target}" \
            in message, message
    assert (tree(project.path), tree(copy.path)) == before


def test_an_old_database_recorded_elsewhere_is_refused_naming_the_mismatch(tmp_path):
    """A database of schema version 0 holds the absolute paths of the machine it was made on."""
    root = tmp_path / "project"
    shutil.copytree(LEGACY, root)
    legacy = Project(root)
    recorded = sqlite3.connect(legacy.state / "orchestrator.db").execute(
        "SELECT root_path FROM files LIMIT 1").fetchone()[0]
    assert not recorded.startswith(str(tmp_path))
    target_before = tree(legacy.target)
    proc = legacy.cli("rollback", "--all", check=1)
    assert f"the history's files are in {recorded}" in " ".join(proc.stderr.split())
    assert tree(legacy.target) == target_before == DEPLOYED
