"""A state folder written by release 0.1.0 (schema version 0: no step kinds, re-measurements named "(final)" and
"(without ID)"; made by fixtures/legacy/make_legacy.py): `status` and `report` read it as it is, the first command
that writes migrates it, and `rollback --all` undoes its deployment byte for byte."""
from __future__ import annotations

import json
import shutil
import sqlite3

import pytest

from core_project import FIXTURES, Project, tree
from orchestrator.store import VERSION

LEGACY = FIXTURES / "legacy" / "legacy-v0"
DEPLOYED = {"a.txt": b"A = 2\n", "b.txt": b"B = 3\n", "d.txt": b"D\n"}
ORIGINAL = {"a.txt": b"A = 1\n", "b.txt": b"B = 1\n"}


@pytest.fixture
def legacy(tmp_path) -> Project:
    root = tmp_path / "project"
    shutil.copytree(LEGACY, root)
    db = sqlite3.connect(root / "state" / "orchestrator.db")
    # the history records each root's absolute path, and the project was made in another folder
    for table in ("files", "trees"):
        db.execute(f"UPDATE {table} SET root_path = ?", [str(root / "target")])
    db.commit()
    db.close()
    return Project(root)


def schema_version(project: Project) -> int:
    return project.db().execute("PRAGMA user_version").fetchone()[0]


def test_status_and_report_read_the_old_database_without_changing_it(legacy):
    db_file = legacy.state / "orchestrator.db"
    before = db_file.read_bytes()
    first = legacy.status("--run", "1")
    assert [(s["plugin"], s["outcome"], s["reason"]) for s in first["steps"]] == [
        ("a", "kept", None), ("b", "kept", None), ("c", "rolled_back", "incorrect"), ("d", "kept", None)]
    assert first["final"]["plugin"] == "(final)" and first["final"]["better"]
    assert first["final"]["gain"] == pytest.approx(8.0)
    assert [(a["plugin"], round(a["gain"], 6)) for a in first["attribution"]] == [("a", 1.0), ("b", 2.0), ("d", 0.5)]
    latest = legacy.status()
    assert latest["run"]["id"] == 2
    assert [(s["plugin"], s["outcome"], s["reason"]) for s in latest["steps"]] == [
        ("a", "kept", "reverified"), ("b", "kept", "reverified"), ("d", "kept", "reverified")]
    assert "contribution of b: +200.00%" in legacy.cli("status", "--run", "1", check=0).stdout
    legacy.cli("report", "--run", "1", "--out", str(legacy.path / "report"), check=0)
    text = (legacy.path / "report" / "run-1.md").read_text()
    assert "## (final)" in text and "## (without d)" in text and "beats the run's baseline" in text
    assert db_file.read_bytes() == before and schema_version(legacy) == 0


def test_the_first_writer_migrates_and_rollback_undoes_every_byte(legacy):
    shown = legacy.status("--run", "1")
    assert tree(legacy.target) == DEPLOYED
    out = legacy.cli("rollback", "--all", check=0).stdout
    assert all(f"rolled_back {p}" in out for p in "abd")
    assert tree(legacy.target) == ORIGINAL
    assert (legacy.path / "d-undone.txt").read_text() == "undone\n"  # d's own rollback step ran
    assert schema_version(legacy) == VERSION
    kinds = [(r["run_id"], r["plugin"], r["kind"]) for r in legacy.db().execute(
        "SELECT run_id, plugin, kind FROM steps ORDER BY id")]
    assert kinds == [(1, "a", "attempt"), (1, "b", "attempt"), (1, "c", "attempt"), (1, "d", "attempt"),
                     (1, "(final)", "final"), (1, "a", "attribution"), (1, "b", "attribution"),
                     (1, "d", "attribution"), (2, "a", "reverify"), (2, "b", "reverify"), (2, "d", "reverify"),
                     (3, "d", "rollback"), (3, "b", "rollback"), (3, "a", "rollback")]
    assert json.dumps(legacy.status("--run", "1"), sort_keys=True) == json.dumps(shown, sort_keys=True)
    assert legacy.cli("rollback", "--all", check=0).stdout.strip() == "nothing to roll back"


def test_a_database_from_a_newer_release_is_refused_untouched(legacy):
    db = legacy.db()
    db.execute("PRAGMA user_version = 99")
    db.commit()
    db.close()
    before = (legacy.state / "orchestrator.db").read_bytes()
    proc = legacy.cli("rollback", "--all", check=1)
    assert "written by a newer release" in proc.stderr and "schema version 99" in proc.stderr
    assert (legacy.state / "orchestrator.db").read_bytes() == before and tree(legacy.target) == DEPLOYED
