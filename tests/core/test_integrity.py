"""Blobs are checked against their names before anything is restored from them, and changes the database lost
(damage in its write-ahead log) are found in the intent log, restored and reported."""
from __future__ import annotations

import os
import signal
import sqlite3

import pytest

from core_project import assert_consistent, expected_images, make_project, state_images, tree
from test_crash import wait_for


def kept_blob(project, path: str) -> tuple:
    db = project.db()
    before = db.execute("SELECT f.before FROM files f JOIN deployed d ON d.step_id = f.step_id WHERE f.path = ?",
                        [path]).fetchone()[0]
    return project.state / "blobs" / before


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_damaged_pre_image_is_refused_naming_the_blob(tmp_path, damage):
    project = make_project(tmp_path / "p", plugins=["speedup"])
    project.cli("run", check=0)
    blob = kept_blob(project, "app.txt")
    if damage == "flip":
        blob.write_bytes(blob.read_bytes().replace(b"SPEED = 1", b"SPEED = 9"))
    else:
        blob.unlink()
    before = tree(project.target)
    proc = project.cli("rollback", "--all", check=1)
    message = " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr
    assert f"{blob} is {'damaged' if damage == 'flip' else 'missing'}" in message
    assert f"it holds the image of {project.target / 'app.txt'}" in message
    assert tree(project.target) == before
    assert project.outcomes() == {"speedup": ("kept", None)}


def frames(wal: bytes, page_size: int) -> list[int]:
    """Byte offsets at which each commit of a write-ahead log ends."""
    ends, offset = [], 32
    while offset + 24 + page_size <= len(wal):
        if int.from_bytes(wal[offset + 4:offset + 8], "big"):  # a commit frame records the database size
            ends.append(offset + 24 + page_size)
        offset += 24 + page_size
    return ends


@pytest.mark.parametrize("keep", [0.0, 0.3, 0.6, 0.9])
def test_changes_the_database_lost_are_restored_and_reported(tmp_path, keep):
    """speedup kept, kill-probe applied and measuring, the run killed; then the last commits of the write-ahead
    log are lost (`keep`: the fraction of its commits that survive)."""
    project = make_project(tmp_path / "p", plugins=["speedup"], extra=["kill-probe"], speed_timeout=300)
    original = state_images(project.target)
    proc = project.spawn("run")
    wait_for(project.path / "marker-probe", proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wal = project.state / "orchestrator.db-wal"
    data = wal.read_bytes()
    page_size = int.from_bytes(data[8:12], "big")
    ends = frames(data, page_size)
    wal.write_bytes(data[:ends[int(keep * len(ends))] if keep else 0])
    (project.state / "orchestrator.db-shm").unlink()

    out = project.cli("recover", check=0)
    assert "Traceback" not in out.stderr
    lost = keep == 0.0
    if lost:  # nothing of this run reached the database: both plugins' changes are known from the intent log only
        assert "had no record of it" in out.stderr and "kill-probe" in out.stderr and "speedup" in out.stderr
        assert state_images(project.target) == original
    assert_consistent(project.target, expected_images(original, project.state / "orchestrator.db"))
    project.cli("rollback", "--all", check=0)
    assert state_images(project.target) == original
    assert sqlite3.connect(project.state / "orchestrator.db").execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_reader_holding_a_read_transaction_delays_no_command(tmp_path):
    """Readers of the history in WAL mode never block its writer: a command ends without waiting for a reader's
    snapshot (the write-ahead log is copied into the database file only as far as no reader needs it), and once
    the reader is gone the next command copies the rest and empties the intent log."""
    import time
    project = make_project(tmp_path / "p", plugins=["speedup"])
    project.cli("run", check=0)
    reader = sqlite3.connect(project.state / "orchestrator.db", isolation_level=None)
    reader.execute("BEGIN")
    assert reader.execute("SELECT count(*) FROM steps").fetchone()[0] > 0
    for command in (("run",), ("rollback", "--all")):
        started = time.monotonic()
        project.cli(*command, check=0)
        assert time.monotonic() - started < 9, command  # a checkpoint that waited for the reader took 10 s more
    intents = project.state / "intents.jsonl"
    assert intents.stat().st_size > 0  # the reader's snapshot held the write-ahead log back
    reader.execute("COMMIT")
    reader.close()
    project.cli("run", check=0)
    assert not intents.exists()
    assert project.outcomes() == {"speedup": ("kept", None)}
