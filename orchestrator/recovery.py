"""Bringing the target back to the last kept state after a command died or was interrupted.

Only what the dead command changed is put back. Its changes are told from later ones by time: the heartbeat
(journal.alive) is touched before every write the command makes to the target and while any process it started
runs, so a change made more than SETTLE seconds after the last touch is someone else's. A path that is new since
then is left where it is; a recorded path changed since then is not overwritten: recovery refuses, naming it,
unless forced. Pre-images are checked against their hashes before anything is written, and the database's
record is checked against the intent log (intents.py), so a change the database lost is restored and reported.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import images
from orchestrator.errors import UserError
from orchestrator.journal import Journal
from orchestrator.probes.marks import sweep_scope
from orchestrator.probes.runner import kill_group
from orchestrator.store import Store, label

SETTLE = 1.0  # seconds after the last sign of life within which a change still counts as the dead command's


class RecoveryRefused(UserError):
    """Putting the pre-images back would overwrite later changes, or pre-images cannot be trusted."""


@dataclass
class Unit:
    """What one step changed: rows (pre-images of paths) and trees (snapshots of whole roots)."""
    step_id: int
    run_id: int | None
    plugin: str
    step: dict | None  # its row, None when the database lost it
    rows: list[dict] = field(default_factory=list)
    trees: list[tuple[str, str]] = field(default_factory=list)  # (root name, manifest blob)
    unrecorded: list[str] = field(default_factory=list)  # what only the intent log knew of

    @property
    def name(self) -> str:
        return label(self.step) if self.step else self.plugin


@dataclass
class Plan:
    items: list[tuple[Path, str | None, int | None]] = field(default_factory=list)  # (path, image, mode) to put
    left: list[tuple[Path, str]] = field(default_factory=list)  # (path, why it is left as it is)
    conflicts: list[tuple[Path, str | None, int | None]] = field(default_factory=list)  # changed since the stop
    damaged: list[tuple[Path, Path, str]] = field(default_factory=list)  # (blob, path, why)


@dataclass
class Recovered:
    unit: Unit
    plan: Plan

    @property
    def step(self) -> dict:
        return self.unit.step or {"id": self.unit.step_id, "run_id": self.unit.run_id, "plugin": self.unit.plugin,
                                  "kind": "attempt", "state": "unrecorded"}


def recover(store: Store, journal: Journal, run_status: str = "interrupted", detail: str | None = None,
            force: bool = False, own: bool = False) -> list[Recovered]:
    """Kill leftover processes (recorded, and any carrying this state folder's mark), put back what every unfinished
    step changed, newest first, and close open runs. `own`: the caller is the command that made the changes (a
    signal or an error inside a run), so nothing happened behind its back. RecoveryRefused, before anything is
    written, when a recorded path changed after the stop or a pre-image is missing or damaged; `force` overwrites
    the former and leaves the latter as they are.

    Call only while holding the state lock: then every open run is dead (or is the caller's own).
    """
    for proc in store.open_processes():
        kill_group(proc["pid"], proc["pgid"], proc["create_time"])
        store.end_process(proc["id"])
    sweep_scope(store.path.parent)  # also those started just before their row was written, and escaped ones
    last = None if own else journal.last_alive()
    cutoff = math.inf if last is None else last + SETTLE
    units = pending(store, journal)
    plans = [plan(journal, u, cutoff) for u in units]
    if not force:
        refuse_if_needed(units, plans, last)
    done = []
    for unit, p in zip(units, plans):
        p.left += [(path, f"its pre-image {blob.name} is {why}") for blob, path, why in p.damaged]
        damaged = {path for _, path, _ in p.damaged}
        journal.put([i for i in p.items + p.conflicts if i[0] not in damaged])  # conflicts: only when forced
        note = f"; left as they are: {describe_left(p.left)}" if p.left else ""
        if unit.unrecorded:
            store.event(unit.run_id, "unrecorded", f"{unit.name} (step {unit.step_id}) changed "
                        f"{', '.join(unit.unrecorded)} but the history had no record of it (a damaged database or "
                        f"write-ahead log): restored from the intent log{note}")
        if unit.step is not None and unit.step["state"] != "done":
            store.finish_step(unit.step_id, "rolled_back", "interrupted",
                              (detail or f"the run stopped during {unit.step['state']}; files restored") + note)
            store.event(unit.run_id, "recovered", f"{unit.name}: restored pre-images{note}", unit.step_id)
        done.append(Recovered(unit, p))
    for run in store.open_runs():
        store.finish_run(run["id"], run_status, detail)
    journal.settle()
    return done


def pending(store: Store, journal: Journal) -> list[Unit]:
    """Unfinished steps, and steps whose changes only the intent log knows of, newest first."""
    units: dict[int, Unit] = {}
    for step in store.open_steps():
        units[step["id"]] = Unit(step["id"], step["run_id"], step["plugin"], step, store.file_rows(step["id"]),
                                 [(t["root"], t["manifest"]) for t in store.tree_rows(step["id"])])
    for record in journal.intents.read():
        step_id = record["step"]
        known = units.get(step_id)
        row = known.step if known else store.step_or_none(step_id)
        same_step = row is not None and row["run_id"] == record.get("run") and row["plugin"] == record.get("plugin")
        if "tree" in record:
            covered = same_step and any(t["root"] == record["root"] for t in store.tree_rows(step_id))
        else:
            covered = same_step and any(r["root"] == record.get("root") and r["path"] == record.get("path")
                                        for r in store.file_rows(step_id))
        if covered:
            continue
        unit = units.get(step_id) if same_step else None
        if unit is None:
            unit = units.setdefault(step_id, Unit(step_id, record.get("run"), str(record.get("plugin")),
                                                  row if same_step else None))
        if "tree" in record:
            unit.trees.append((record["root"], record["tree"]))
            unit.unrecorded.append(f"anything in root {record['root']!r}")
        else:
            unit.rows.append(record)
            unit.unrecorded.append(str(record.get("path")))
    return [units[k] for k in sorted(units, reverse=True)]


def changed_at(path: Path) -> float:
    """When the path last changed; for a path that is gone, when its nearest remaining folder last did."""
    for p in (path, *path.parents):
        try:
            return os.lstat(p).st_ctime
        except (FileNotFoundError, NotADirectoryError):
            continue
    return math.inf


def plan(journal: Journal, unit: Unit, cutoff: float) -> Plan:
    """What to put back for one step: every path it changed up to `cutoff` gets its pre-image (a snapshotted root
    as a whole, a recorded path by its row); later changes are left (new paths) or conflicts (recorded ones)."""
    wanted: dict[Path, tuple] = {}
    known_after: dict[Path, tuple] = {}
    p = Plan()
    for root_name, manifest in unit.trees:
        root = journal.roots[root_name]
        why = journal.blob_problem(manifest)
        if why:  # without the snapshot the root cannot be put back; its recorded paths still can
            p.damaged.append((journal.blobs / manifest, root, f"{why} (the snapshot of the whole root)"))
            continue
        entries = journal.entries({"manifest": manifest})
        for rel, (image, mode) in entries.items():
            wanted[root / rel] = (image, mode)
        for rel, path, _ in images.walk(root):
            wanted.setdefault(path, (None, None))
    for r in unit.rows:  # a path recorded before a command's snapshot holds an older pre-image than the snapshot
        path = journal.path(r)
        wanted[path] = (r["before"], r["before_mode"])
        if r.get("sealed"):
            known_after[path] = (r["after"], r["after_mode"])
    for path, want in wanted.items():
        try:
            now = images.read(path)
        except (images.TouchError, OSError) as e:
            now = (f"unreadable: {e}", None)
        if images.same(now, want):
            continue
        if (path in known_after and images.same(now, known_after[path])) or changed_at(path) <= cutoff:
            p.items.append((path, *want))
        elif want[0] is None:
            p.left.append((path, "new since the run stopped"))
        else:
            p.conflicts.append((path, *want))
    holding = {parent for path, _ in p.left for parent in path.parents}
    for item in [i for i in p.items if i[1] is None and i[0] in holding]:
        p.items.remove(item)
        p.left.append((item[0], "holds what is new since the run stopped"))
    for path, image, _ in p.items + p.conflicts:
        if images.is_blob(image) and (why := journal.blob_problem(image)):
            p.damaged.append((journal.blobs / image, path, why))
    return p


def describe_left(left: list[tuple[Path, str]]) -> str:
    return "; ".join(f"{path} ({why})" for path, why in left)


def refuse_if_needed(units: list[Unit], plans: list[Plan], last: float | None) -> None:
    problems = []
    conflicts = [f"{path} ({u.name}, step {u.step_id})" for u, p in zip(units, plans) for path, _, _ in p.conflicts]
    if conflicts:
        stopped = time.strftime("%H:%M:%S", time.localtime(last)) if last else "?"
        problems.append(f"changed after the run stopped (its last sign of life: {stopped}), so putting the "
                        f"pre-image back would overwrite a later change: {'; '.join(conflicts)}")
    damaged = [f"{path}: its pre-image {blob} is {why}" for p in plans for blob, path, why in p.damaged]
    if damaged:
        problems.append(f"cannot be restored: {'; '.join(damaged)}")
    if problems:
        raise RecoveryRefused(
            "recovery refused, nothing was changed. " + ". ".join(problems) + ". Check these paths, then "
            "`orchestrator recover --force` overwrites those changed after the run stopped and leaves those "
            "without a usable pre-image as they are")
