"""A kept plugin whose files someone changed since: while its change is still in place it stays kept (and its
record takes the later edit in, so a rollback keeps that edit); where it is not, it is undone for real as far as
its change can be told apart from the edit, and staged again. The history always says what the target holds."""
from __future__ import annotations

from core_project import add_plugin, assert_consistent, expected_images, make_project, state_images

NOTE = "# tuned by hand\n"


def stacked(tmp_path):
    """speedup (SPEED 1 -> 2) and faster (2 -> 3, requiring speedup), both kept, in one file."""
    project = make_project(tmp_path / "p", plugins=["speedup"])
    add_plugin(project, {"id": "faster", "order": 20, "requires": ["speedup"],
                         "apply": [{"replace": {"path": "app.txt", "old": "SPEED = 2", "new": "SPEED = 3"}}]})
    original = (project.target / "app.txt").read_text()
    project.cli("run", check=0)
    assert project.outcomes() == {"speedup": ("kept", None), "faster": ("kept", None)}
    return project, original


def edit(project, old: str, new: str) -> str:
    app = project.target / "app.txt"
    app.write_text(app.read_text().replace(old, new) + NOTE)
    return app.read_text()


def deployed(project) -> list[str]:
    return [r[0] for r in project.db().execute("SELECT plugin FROM deployed ORDER BY kept_at")]


def test_a_comment_added_to_a_kept_file_leaves_its_plugins_kept(tmp_path):
    project, original = stacked(tmp_path)
    edited = edit(project, "", "")
    project.cli("run", check=0)
    assert project.outcomes() == {"speedup": ("kept", "already_applied"), "faster": ("kept", "already_applied")}
    assert (project.target / "app.txt").read_text() == edited
    assert deployed(project) == ["speedup", "faster"]
    assert_consistent(project.target, expected_images(state_images(project.target), project.state / "orchestrator.db"))
    project.cli("run", check=0)  # nothing changed since: found applied again, the records unchanged
    assert project.outcomes() == {"speedup": ("kept", "already_applied"), "faster": ("kept", "already_applied")}
    project.cli("rollback", "--all", check=0)  # the plugins' changes are undone, the comment stays
    assert (project.target / "app.txt").read_text() == original + NOTE


def test_a_change_undone_by_hand_is_rolled_back_for_real_and_judged_again(tmp_path):
    project, original = stacked(tmp_path)
    edit(project, "SPEED = 3", "SPEED = 1")
    project.cli("run", check=0)
    steps = project.status()["steps"]
    assert [(s["plugin"], s["outcome"], s["reason"]) for s in steps] == [
        ("faster", "rolled_back", "changed_since"), ("speedup", "rolled_back", "changed_since"),
        ("speedup", "kept", None), ("faster", "kept", None)]
    assert "app.txt" in steps[0]["detail"]
    assert (project.target / "app.txt").read_text() == original.replace("SPEED = 1", "SPEED = 3") + NOTE
    assert deployed(project) == ["speedup", "faster"]
    project.cli("rollback", "--all", check=0)
    assert (project.target / "app.txt").read_text() == original + NOTE


def test_a_change_overwritten_by_hand_is_left_to_the_hand_and_no_longer_kept(tmp_path):
    project, original = stacked(tmp_path)
    edited = edit(project, "SPEED = 3", "SPEED = 7")
    project.cli("run", check=0)
    outcomes = project.outcomes()
    assert outcomes == {"speedup": ("rolled_back", "apply_failed"), "faster": ("skipped", "dependency_not_kept")}
    undone = [s for s in project.status()["steps"] if s["reason"] == "changed_since"]
    assert {s["plugin"] for s in undone} == {"speedup", "faster"}
    assert all("left as it is" in s["detail"] and "app.txt" in s["detail"] for s in undone), undone
    assert (project.target / "app.txt").read_text() == edited
    assert deployed(project) == []
    project.cli("rollback", "--all", check=0)
    assert (project.target / "app.txt").read_text() == edited
