"""Blobs are checked against their names before anything is restored from them; changes the database lost
(damage in its write-ahead log) are found in the intent log, restored and reported; a recorded path is written
only inside its root, through real folders."""
from __future__ import annotations

import os
import signal
import sqlite3

import pytest

from core_project import add_plugin, assert_consistent, expected_images, images, make_project, state_images, tree
from test_crash import wait_for
from test_damaged_state import killed_in_probe


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


def kept_in_a_folder(tmp_path):
    """A plugin kept that edits app.txt, and conf/serve.yaml by a command; a file outside the target."""
    project = make_project(tmp_path / "p", plugins=[])
    add_plugin(project, {"id": "tuned", "apply": [
        {"replace": {"path": "app.txt", "old": "SPEED = 1", "new": "SPEED = 2"}},
        {"command": {"run": ["python", "-c", "from pathlib import Path; p = Path('conf/serve.yaml'); "
                                               "p.write_text(p.read_text().replace('seqs: 1', 'seqs: 8'))"]}}]})
    project.cli("run", check=0)
    assert project.outcomes() == {"tuned": ("kept", None)}
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_bytes(b"not the target's\n")
    return project, outside


@pytest.mark.parametrize("force", [False, True])
def test_a_folder_replaced_by_a_link_out_of_the_target_is_not_written_through(tmp_path, force):
    project, outside = kept_in_a_folder(tmp_path)
    os.rename(project.target / "conf", outside / "conf")  # the kept serve.yaml now lies outside, linked back
    os.symlink(outside / "conf", project.target / "conf")
    before = images(project.target), images(outside)
    proc = project.cli("rollback", "--all", *(["--force"] if force else []), check=1)
    message = " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr
    assert f"{project.target / 'conf' / 'serve.yaml'}" in message and "symlink" in message, message
    assert "nothing was changed" in message, message
    assert (images(project.target), images(outside)) == before
    assert project.outcomes() == {"tuned": ("kept", None)}


@pytest.mark.parametrize("tampered", ["../../outside/victim.txt", "/dev/../" + "x"])
def test_a_recorded_path_leading_out_of_the_target_is_refused(tmp_path, tampered):
    project, outside = kept_in_a_folder(tmp_path)
    tampered = tampered if tampered.startswith("..") else str(outside / "victim.txt")  # also an absolute path
    db = project.db()
    db.execute("UPDATE files SET path = ? WHERE path = 'app.txt'", [tampered])
    db.commit()
    db.close()
    before = images(project.target), images(outside)
    proc = project.cli("rollback", "--all", "--force", check=1)
    message = " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr
    assert repr(tampered) in message and "nothing was changed" in message, message
    assert (images(project.target), images(outside)) == before
    assert project.outcomes() == {"tuned": ("kept", None)}


def test_recovery_refuses_a_recorded_path_leading_out_of_the_target(tmp_path):
    project, _ = killed_in_probe(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not the target's\n")
    db = project.db()
    db.execute("UPDATE files SET path = '../../victim.txt' WHERE path = 'app.txt' AND step_id = "
               "(SELECT id FROM steps WHERE plugin = 'kill-probe')")
    db.commit()
    db.close()
    before = images(project.target), victim.read_bytes()
    proc = project.cli("recover", "--force", check=1)
    message = " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr
    assert "'../../victim.txt'" in message and "nothing was changed" in message, message
    assert (images(project.target), victim.read_bytes()) == before


def test_a_step_does_not_record_a_path_beyond_a_symlink(tmp_path):
    """A path through a link inside the target could not be restored through real folders: the step fails."""
    project = make_project(tmp_path / "p", plugins=[])
    os.symlink("conf", project.target / "alias")
    add_plugin(project, {"id": "through-link", "apply": [
        {"replace": {"path": "alias/serve.yaml", "old": "max-num-seqs: 1", "new": "max-num-seqs: 8"}}]})
    before = images(project.target)
    project.cli("run", check=0)
    step = project.status()["steps"][0]
    assert (step["outcome"], step["reason"]) == ("rolled_back", "apply_failed"), step
    assert "alias is a symlink" in step["detail"], step
    assert images(project.target) == before


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
