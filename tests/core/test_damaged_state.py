"""Damaged state: a database truncated, garbage or emptied, a blob of an open step deleted, a disk that fills
during a run. Each ends in a message naming the file and what to do, never a traceback; `status` never shows a
dead run as running; `recover` gets out of every case that can be recovered."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core_project import assert_consistent, expected_images, fault_run, make_project, state_images, tree
from test_crash import wait_for

DAMAGE = {
    "truncated": lambda data: data[:len(data) // 2],
    "garbage": lambda data: bytes((b * 7 + 13) % 256 for b in data),
    "zero-length": lambda data: b"",
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_database_is_named_with_what_to_do(tmp_path, damage):
    project = make_project(tmp_path / "p", plugins=["speedup"])
    project.cli("run", check=0)
    db = project.state / "orchestrator.db"
    db.write_bytes(DAMAGE[damage](db.read_bytes()))
    before = files(project.path)
    for command in (("run",), ("rollback", "--all"), ("recover",), ("status",), ("report",)):
        proc = project.cli(*command)
        message = " ".join(proc.stderr.split())
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (command, proc.stderr)
        assert str(db) in message, (command, message)
        assert "move the state folder" in message and "from a backup" in message, (command, message)
    assert files(project.path) == before


def files(root: Path) -> dict:
    """The project byte for byte, but for SQLite's shared-memory index (-shm), which any reader rebuilds."""
    return {k: v for k, v in tree(root).items() if not k.endswith("-shm")}


def killed_in_probe(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup"], extra=["kill-probe"], speed_timeout=300)
    original = state_images(project.target)
    proc = project.spawn("run")
    wait_for(project.path / "marker-probe", proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    (project.path / "marker-probe").unlink()
    return project, original


def test_a_dead_run_is_never_shown_running(tmp_path):
    project, _ = killed_in_probe(tmp_path)
    data = project.status()
    assert data["run"]["status"] == "interrupted" and "is gone" in data["run"]["detail"]
    assert [r["status"] for r in project.status("--runs")] == ["interrupted"]
    assert {s["plugin"]: s["state"] for s in data["steps"]}["kill-probe"] == "measuring"  # not recovered yet


def test_a_deleted_blob_of_an_open_step_is_named_and_recover_force_gets_out(tmp_path):
    project, original = killed_in_probe(tmp_path)
    db = project.db()
    before = db.execute("SELECT f.before FROM files f JOIN steps s ON s.id = f.step_id WHERE s.plugin = 'kill-probe' "
                        "AND f.path = 'app.txt'").fetchone()[0]
    db.close()
    blob = project.state / "blobs" / before
    blob.unlink()
    target = tree(project.target)
    for command in (("run",), ("recover",), ("rollback", "--all")):
        proc = project.cli(*command, check=1)
        message = " ".join(proc.stderr.split())
        assert "Traceback" not in proc.stderr
        assert f"{project.target / 'app.txt'}: its pre-image {blob} is missing" in message, message
        assert "orchestrator recover --force" in message
        assert tree(project.target) == target
    out = project.cli("recover", "--force", check=0).stdout
    assert "rolled_back kill-probe" in " ".join(out.split())
    assert f"{project.target / 'app.txt'} (its pre-image {blob.name} is missing)" in " ".join(out.split())
    assert not (project.target / "sub").exists()  # what could be restored was
    assert b"MODE = KILLME" in (project.target / "app.txt").read_bytes()  # what could not is left, and said so
    (project.target / "app.txt").write_bytes((project.target / "app.txt").read_bytes().replace(b"KILLME", b"plain"))
    project.cli("run", "--only", "speedup", check=0)  # the state folder is usable again


@pytest.mark.parametrize("where, n", [("blob", 1), ("blob", 3), ("target", 1), ("target", 2), ("db", 3), ("db", 5)])
def test_a_disk_filling_during_a_run(tmp_path, where, n):
    project = make_project(tmp_path / "p", plugins=["speedup", "command-step", "no-gain"])
    original = state_images(project.target)
    proc = fault_run(project, where, n, "run")
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "disk is full" in message or "no space left" in message, message
    assert "the target is back at its last kept state" in message or "orchestrator recover" in message, message
    assert str(project.state if where != "target" else project.target) in message
    data = project.status()
    assert data["run"]["status"] in ("failed", "interrupted") and data["run"]["detail"]
    project.cli("recover", check=0)  # space is free again
    assert all(s["state"] == "done" for s in project.status()["steps"])
    assert_consistent(project.target, expected_images(original, project.state / "orchestrator.db"))
    project.cli("rollback", "--all", check=0)
    assert state_images(project.target) == original


def test_a_real_full_disk_under_the_state_folder(tmp_path):
    state = tmp_path / "small"
    state.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(state)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and tmpfs to make a small file system")
    try:
        project = make_project(tmp_path / "p", plugins=["speedup"])
        (project.target / "big.bin").write_bytes(b"SPEED = 1\n" + os.urandom(400_000))
        folder = project.path / "plugins" / "bigger"
        folder.mkdir()
        (folder / "plugin.yaml").write_text("id: bigger\napply:\n  - command: {run: [python, -c, \"import os; "
                                            "open('big.bin', 'ab').write(os.urandom(400000))\"]}\n")
        config = project.config.read_text().replace("state: state", f"state: {state / 'state'}")
        project.config.write_text(config)
        original = state_images(project.target)
        proc = project.cli("run")
        message = " ".join(proc.stderr.split())
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
        assert "disk is full" in message or "no space left" in message, message
        assert str(state / "state") in message
        assert state_images(project.target)["big.bin"] == original["big.bin"]
        data = project.status()
        assert data["run"]["status"] != "running"
    finally:
        subprocess.run(["umount", str(state)], check=False)


def test_a_database_stopped_while_it_was_created(tmp_path):
    """A command killed between creating the database and committing its tables leaves a file with no table."""
    import sqlite3
    project = make_project(tmp_path / "p", plugins=["speedup"])
    project.state.mkdir()
    db = sqlite3.connect(project.state / "orchestrator.db")
    db.execute("PRAGMA journal_mode=WAL")
    db.close()
    assert (project.state / "orchestrator.db").stat().st_size > 0
    assert "no runs recorded yet" in project.cli("status", check=1).stderr
    assert project.cli("recover", check=0).stdout.strip() == "nothing to recover"
    project.cli("run", check=0)
    assert project.outcomes() == {"speedup": ("kept", None)}


HOT_JOURNAL = """
import os, sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA journal_mode=DELETE")
conn.execute("PRAGMA cache_size=1")  # pages spill into the file mid-transaction, the journal holds their old images
conn.execute("BEGIN")
conn.execute("CREATE TABLE filler (x BLOB)")
for _ in range(200):
    conn.execute("INSERT INTO filler VALUES (?)", [os.urandom(4000)])
os.kill(os.getpid(), 9)
"""


def test_a_database_killed_while_created_is_rolled_back_not_refused(tmp_path):
    """A command killed while it created the database, before the switch to WAL, leaves a hot rollback journal;
    the next command's read-only look at the history must let SQLite roll it back (it used to fail with
    SQLITE_READONLY_ROLLBACK), and the run goes on from an empty history."""
    project = make_project(tmp_path / "p", plugins=["speedup"])
    db = project.state / "orchestrator.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", HOT_JOURNAL, str(db)], timeout=60)
    assert Path(f"{db}-journal").stat().st_size > 0
    status = project.cli("status")
    assert "no runs recorded yet" in status.stderr and "Traceback" not in status.stderr, status.stderr
    recover = project.cli("recover")
    assert recover.returncode == 0 and "Traceback" not in recover.stderr, (recover.stdout, recover.stderr)
    project.cli("run", check=0)
    assert not Path(f"{db}-journal").exists()
