"""What is kept stays coherent: a plugin a kept plugin requires is rolled back only with it, a mode changed by
hand is drift, and blobs nothing needs any more are collected."""
from __future__ import annotations

import os

from core_project import add_plugin, make_project, state_images, tree


def test_a_required_plugin_is_rolled_back_only_with_its_dependents(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup", "command-step"])
    original = tree(project.target)
    project.cli("run", check=0)
    assert project.outcomes() == {"speedup": ("kept", None), "command-step": ("kept", None)}
    before = tree(project.target), history(project)
    proc = project.cli("rollback", "speedup", check=1)
    message = " ".join(proc.stderr.split())
    assert "command-step requires speedup" in message
    assert "orchestrator rollback command-step speedup" in message
    assert (tree(project.target), history(project)) == before
    out = project.cli("rollback", "speedup", "command-step", check=0).stdout
    assert "rolled_back command-step" in out and "rolled_back speedup" in out
    assert tree(project.target) == original


def history(project) -> list:
    db = project.db()
    return [list(map(tuple, db.execute(f"SELECT * FROM {table} ORDER BY 1"))) for table in ("deployed", "steps", "runs")]


def test_a_mode_changed_by_hand_is_drift(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup"])
    project.cli("run", check=0)
    os.chmod(project.target / "app.txt", 0o600)
    proc = project.cli("rollback", "speedup", check=1)
    assert "files changed since they were kept (use --force to overwrite them): speedup: app.txt" in proc.stderr
    assert (project.target / "app.txt").stat().st_mode & 0o777 == 0o600
    project.cli("run", check=0)  # its change is still in place: kept, its record taking the new mode in
    assert project.outcomes()["speedup"] == ("kept", "already_applied")
    assert "app.txt changed since and its change is still in place" in project.status()["steps"][0]["detail"]
    project.cli("rollback", "speedup", check=0)  # its change undone, the mode set by hand kept
    assert (project.target / "app.txt").read_text().startswith("SPEED = 1\n")
    assert (project.target / "app.txt").stat().st_mode & 0o777 == 0o600


def blobs(project) -> set[str]:
    return {p.name for p in (project.state / "blobs").iterdir()}


def test_blobs_nothing_needs_are_collected(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup", "half-way", "bad-verify", "no-gain", "command-step"])
    original = state_images(project.target)
    project.cli("run", check=0)
    db = project.db()
    kept = {i for row in db.execute("SELECT f.before, f.after FROM files f JOIN deployed d ON d.step_id = f.step_id")
            for i in row if i and len(i) == 64}
    everything = blobs(project)
    assert kept < everything  # the rolled-back attempts' images and the command step's snapshot are there too
    out = project.cli("gc", check=0).stdout
    assert f"removed {len(everything - kept)} blob(s)" in out
    assert blobs(project) == kept
    project.cli("rollback", "--all", check=0)  # what a rollback needs was kept
    assert state_images(project.target) == original
    assert blobs(project) == set()  # and after rollback --all nothing is needed


def test_a_folder_a_kept_plugin_made_is_not_deleted_with_what_others_put_in_it(tmp_path):
    """Rolling back removes the folder the plugin created, but a file someone put there since is nobody's to
    delete: the rollback is refused naming it, the target and history unchanged; --force removes it too."""
    project = make_project(tmp_path / "p", plugins=[])
    add_plugin(project, {"id": "extra", "apply": [
        {"replace": {"path": "app.txt", "old": "SPEED = 1", "new": "SPEED = 2"}},
        {"deploy": {"src": "files/extra.txt", "dest": "new/deeper/extra.txt"}}]})
    (project.path / "plugins" / "extra" / "files").mkdir()
    (project.path / "plugins" / "extra" / "files" / "extra.txt").write_text("extra\n")
    original = tree(project.target)
    project.cli("run", check=0)
    assert project.outcomes()["extra"][0] == "kept"
    (project.target / "new" / "deeper" / "notes.txt").write_text("an operator's notes\n")
    before = tree(project.target), history(project)
    proc = project.cli("rollback", "--all", check=1)
    message = " ".join(proc.stderr.split())
    assert "new/deeper/notes.txt" in message and "extra" in message, message
    assert (tree(project.target), history(project)) == before
    project.cli("rollback", "--all", "--force", check=0)
    assert tree(project.target) == original
