"""Bringing the target back to the last kept state after a command died or was interrupted.

Only what the dead command changed is put back, and only where that is certain: a change that cannot be attributed
to it with certainty is never deleted or reverted. Such a change is named and left as it is, or, on a path the
command changed too, refused (nothing is written) unless forced. Certainty rests on records written before the
change, never on when a change was made:

- Every write of the orchestrator's own to a target (declarative steps, measurement arms, rollbacks) is announced in
  the intent log (intents.py) with the image about to be written, as a blob, before the write. A path that holds its
  pre-image, an announced image, or a mix of an announced file and the file it was written over in place (a write
  cut short) holds nothing anyone else wrote, however long the write took.
- A command or python step's processes run under a keeper (probes/keeper.py), which ends them the moment the
  orchestrator dies or gives up on them, and then records in the intent log what they changed in their root against
  the step's snapshot, by image, and which paths changed again after they had all ended. A path they changed is put
  back when it holds what they left there; a path they did not change is someone else's.
- A step's process that started but whose end was not recorded (its keeper killed too), or a snapshot taken before
  processes had keepers, leaves every change in that root unattributable: all are refused by name, and `force` puts
  the root back as snapshotted.
- A sealed step (its apply finished) has rows with post-images: those are all it changed.
- A file named as the orchestrator's own temporary file (`.NAME.orch-tmp`) beside a path the step wrote is its own.

Before it looks, recovery lets the dead run's keepers finish, then kills what is left of the processes it started
(recorded, and any carrying this state folder's mark), so that nothing the run started changes the target meanwhile.
Pre-images are checked against their hashes before anything is written, and the database's record is checked against
the intent log, so a change the database lost is restored and reported.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import images
from orchestrator.errors import UserError
from orchestrator.journal import TMP_SUFFIX, BlobError, Journal
from orchestrator.probes.marks import sweep_scope, wait_keepers
from orchestrator.probes.runner import KEEPER_GRACE, kill_group
from orchestrator.store import Store, label

UNTOLD = "its processes ended without a record of what they changed, so no change in its root can be told apart"
AGAIN = "changed again after the step changed it"
UNREADABLE = "unreadable: "


class RecoveryRefused(UserError):
    """Putting the pre-images back would overwrite later changes, or pre-images cannot be trusted."""


@dataclass
class Unit:
    """What one step changed: rows (pre-images of paths), trees (snapshots of whole roots), and what the intent log
    says it wrote (`writes`) and what its processes changed (`processes`, the keepers' records)."""
    step_id: int
    run_id: int | None
    plugin: str
    step: dict | None  # its row, None when the database lost it
    rows: list[dict] = field(default_factory=list)
    trees: list[tuple[str, str]] = field(default_factory=list)  # (root name, manifest blob)
    unrecorded: list[str] = field(default_factory=list)  # what only the intent log knew of
    writes: list[dict] = field(default_factory=list)
    processes: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return label(self.step) if self.step else self.plugin


@dataclass
class Plan:
    items: list[tuple[Path, str | None, int | None]] = field(default_factory=list)  # (path, image, mode) to put
    left: list[tuple[Path, str]] = field(default_factory=list)  # (path, why it is left as it is)
    conflicts: list[tuple[Path, str | None, int | None, str]] = field(default_factory=list)  # ... and why refused
    damaged: list[tuple[Path, Path, str]] = field(default_factory=list)  # (blob, path, why)

    def writes(self) -> list[tuple[Path, str | None, int | None]]:
        """What to put on disk once nothing is refused (or all is forced): the items and the conflicts, less what has
        no usable blob."""
        damaged = {path for _, path, _ in self.damaged}
        return [(path, image, mode) for path, image, mode, *_ in self.items + self.conflicts if path not in damaged]


@dataclass
class Recovered:
    unit: Unit
    plan: Plan

    @property
    def step(self) -> dict:
        return self.unit.step or {"id": self.unit.step_id, "run_id": self.unit.run_id, "plugin": self.unit.plugin,
                                  "kind": "attempt", "state": "unrecorded"}


@dataclass
class Report:
    steps: list[Recovered]
    ended: list[str]  # leftover processes killed
    closed: list[int]  # runs recorded as ended


def recover(store: Store, journal: Journal, run_status: str = "interrupted", detail: str | None = None,
            force: bool = False, own: bool = False) -> Report:
    """End what the stopped runs started, put back what every unfinished step changed, newest first, and close open
    runs. `own`: the caller is the command that made the changes (a signal or an error inside a run), so a path it
    changed and someone changed again is its own to put back. RecoveryRefused, before anything is written, when a
    path the stopped command changed does not hold what it left, or a pre-image is missing or damaged; `force`
    overwrites the former and leaves the latter as they are.

    Call only while holding the state lock: then every open run is dead (or is the caller's own).
    """
    ended = end_leftovers(store)
    units = pending(store, journal)
    ahead: dict[Path, tuple] = {}  # what the newer steps' plans will have put there
    plans = [plan(journal, u, ahead) for u in units]
    if not (force or own):
        refuse_if_needed(units, plans)
    done = []
    for unit, p in zip(units, plans):
        p.left += [(path, f"its pre-image {blob.name} is {why}") for blob, path, why in p.damaged]
        journal.put(p.writes())
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
    closed = []
    for run in store.open_runs():
        store.finish_run(run["id"], run_status, detail)
        closed.append(run["id"])
    journal.settle()
    return Report(done, ended, closed)


def undo(store: Store, journal: Journal, step_id: int) -> list[tuple[Path, str]]:
    """Put back what a step of the running command changed (its rollback), also where someone changed it again; what
    only others changed meanwhile is left as it is, and returned with why."""
    step = store.step(step_id)
    unit = Unit(step_id, step["run_id"], step["plugin"], step, store.file_rows(step_id),
                [(t["root"], t["manifest"]) for t in store.tree_rows(step_id)])
    attach(unit, journal.intents.read())
    p = plan(journal, unit)
    if p.damaged:
        raise BlobError([(blob, f"the image of {path}", why) for blob, path, why in p.damaged])
    journal.put(p.writes())
    return p.left


def end_leftovers(store: Store) -> list[str]:
    """Let the stopped runs' keepers record what their processes changed, then kill every process those runs left;
    what was killed."""
    state_dir = store.path.parent
    wait_keepers(state_dir, KEEPER_GRACE)
    ended = []
    for proc in store.open_processes():
        if kill_group(proc["pid"], proc["pgid"], proc["create_time"]):
            what = " ".join(proc["what"].split())
            ended.append(f"{what if len(what) <= 80 else what[:77] + '...'} (pid {proc['pid']}) of run {proc['run_id']}")
        store.end_process(proc["id"])
    if swept := sweep_scope(state_dir):  # also those started just before their row was written, and escaped ones
        ended.append(f"{swept} more process(es) started for this state folder")
    return ended


def pending(store: Store, journal: Journal) -> list[Unit]:
    """Unfinished steps, and steps whose changes only the intent log knows of, newest first."""
    units: dict[int, Unit] = {}
    for step in store.open_steps():
        units[step["id"]] = Unit(step["id"], step["run_id"], step["plugin"], step, store.file_rows(step["id"]),
                                 [(t["root"], t["manifest"]) for t in store.tree_rows(step["id"])])
    records = journal.intents.read()
    for record in records:
        if "writes" in record or "process" in record:
            continue  # what the step wrote, not a change to record
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
    for unit in units.values():
        attach(unit, records)
    return [units[k] for k in sorted(units, reverse=True)]


def attach(unit: Unit, records: list[dict]) -> None:
    """The step's records of what it wrote and of its processes."""
    for r in records:
        if r["step"] == unit.step_id and r.get("run") == unit.run_id and r.get("plugin") == unit.plugin:
            if "writes" in r:
                unit.writes.append(r)
            elif "process" in r:
                unit.processes.append(r)


class Evidence:
    """Per path: the pre-image to put back, the images the step is known to have left there, the (over, written)
    pairs of files it rewrote in place, and why what it left there is not known."""

    def __init__(self) -> None:
        self.wanted: dict[Path, tuple] = {}
        self.known: dict[Path, list[tuple]] = defaultdict(list)
        self.rewrites: dict[Path, list[tuple[str, str]]] = defaultdict(list)
        self.untold: dict[Path, str] = {}

    def want(self, path: Path, before: tuple, over: bool = False) -> None:
        if over or path not in self.wanted:
            self.wanted[path] = tuple(before)

    def certain(self, journal: Journal, path: Path, now: tuple, on_disk: bool) -> bool:
        """Whether what `path` holds (`now`, read from it when `on_disk`) is the step's doing: its pre-image or an
        image the step left, mode included, or a mix of a file the step rewrote in place and the file under it."""
        images_left = [self.wanted[path], *self.known[path]]
        if any(images.same(now, left) for left in images_left):
            return True
        modes = {mode for _, mode in images_left}
        if not images.is_blob(now[0]) or now[0].startswith(UNREADABLE) or not (None in modes or now[1] in modes):
            return False
        contents = {image for image, _ in images_left}
        return now[0] in contents or on_disk and any(
            images.is_blob(over) and images.is_blob(new) and not journal.blob_problem(over)
            and not journal.blob_problem(new) and images.spliced(path, journal.blobs / over, journal.blobs / new)
            for over, new in self.rewrites[path])


def plan(journal: Journal, unit: Unit, ahead: dict[Path, tuple] | None = None) -> Plan:
    """What to put back for one step (items), what is someone else's (left), and what the step changed that does not
    hold what it left (conflicts); the rule is in the module's docstring. `ahead`: what plans of newer steps put on
    disk first, updated with this plan's."""
    ahead = {} if ahead is None else ahead

    def current(path: Path) -> tuple:
        if path in ahead:
            return ahead[path]
        if journal.link_on_the_way(path) is not None:  # what a link leads to is not in the target: nothing is
            return None, None
        return _current(path)

    p = Plan()
    ev = Evidence()
    others: dict[Path, tuple] = {}  # in a snapshotted root, not changed by the step: its snapshot's image
    sealed = any(r.get("sealed") for r in unit.rows)  # its rows then say all its processes changed
    for root_name, manifest in unit.trees:
        root = journal.roots[root_name]
        why = journal.blob_problem(manifest)
        if why:  # without the snapshot the root cannot be put back; its recorded paths still can
            p.damaged.append((journal.blobs / manifest, root, f"{why} (the snapshot of the whole root)"))
            continue
        snapshot = json.loads(journal.blob(manifest))
        entries = images.manifest_entries(snapshot)
        mine = [r for r in unit.processes if r.get("root") == root_name]
        ends = [r for r in mine if "ended" in r]
        untold = not sealed and ("ctimes" not in snapshot or bool({r["process"] for r in mine} -
                                                                   {r["process"] for r in ends}))
        for rel in entries.keys() | {rel for rel, _, _ in images.walk(root)}:
            path, before = root / rel, tuple(entries.get(rel, (None, None)))
            for end in ends:
                if rel in end["changed"]:
                    ev.want(path, before)
                    ev.known[path].append(tuple(end["changed"][rel]))
                if rel in end["later"]:
                    ev.want(path, before)
                    ev.untold[path] = AGAIN
            if untold:
                ev.want(path, before)
                ev.untold[path] = UNTOLD
            elif path not in ev.wanted:
                others[path] = before
    for r in unit.rows:  # a path recorded before a command's snapshot holds an older pre-image than the snapshot
        path = journal.path(r)
        ev.want(path, (r["before"], r["before_mode"]), over=True)
        if r.get("sealed"):
            ev.known[path].append((r["after"], r["after_mode"]))
            ev.rewrites[path] += [(r["before"], r["after"]), (r["after"], r["before"])]
    for w in unit.writes:
        path = journal.roots[w["root"]] / w["path"]
        ev.known[path].append((w["writes"], None))
        if w.get("over"):
            ev.rewrites[path].append((w["over"], w["writes"]))
    for path in list(ev.wanted):
        tmp = path.with_name(f".{path.name}{TMP_SUFFIX}")
        if path.name and os.path.lexists(tmp) and not tmp.is_dir():  # a rename into place that did not happen
            ev.wanted[tmp] = (None, None)
            ev.known[tmp].append(_current(tmp))
    for path, want in ev.wanted.items():
        now = current(path)
        if images.same(now, want):
            continue
        if ev.certain(journal, path, now, path not in ahead):
            p.items.append((path, *want))
        else:
            p.conflicts.append((path, *want, ev.untold.get(path, AGAIN)))
    for path, before in others.items():
        if path not in ev.wanted and not images.same(current(path), before):
            p.left.append((path, f"not changed by {unit.name}"))
    _spare_holders(p, set(ev.wanted))
    for path, image, mode, *_ in p.items + p.conflicts:
        ahead[path] = (image, mode)
        if images.is_blob(image) and (why := journal.blob_problem(image)):
            p.damaged.append((journal.blobs / image, path, why))
    return p


def _current(path: Path) -> tuple:
    try:
        return images.read(path)
    except (images.TouchError, OSError) as e:
        return f"{UNREADABLE}{e}", None


def _spare_holders(p: Plan, wanted: set[Path]) -> None:
    """A folder to be removed that holds something else (left, or never seen by the step) stays, and is named."""
    named = {path for path, _ in p.left}
    for path, image, *_ in p.items + p.conflicts:
        if image is None and path.is_dir() and not path.is_symlink():
            found = [inner for _, inner, _ in images.walk(path) if inner not in wanted and inner not in named]
            p.left += [(inner, "not changed by the step") for inner in found]
            named.update(found)
    holding = {parent for path, _ in p.left for parent in path.parents}
    for item in [i for i in p.items + p.conflicts if i[1] is None and i[0] in holding]:
        (p.items if item in p.items else p.conflicts).remove(item)
        p.left.append((item[0], "holds what someone else put there"))


def describe_left(left: list[tuple[Path, str]]) -> str:
    return "; ".join(f"{path} ({why})" for path, why in left)


def refuse_if_needed(units: list[Unit], plans: list[Plan]) -> None:
    problems = []
    by_why: dict[str, list[str]] = defaultdict(list)
    for u, p in zip(units, plans):
        for path, _, _, why in p.conflicts:
            by_why[why].append(f"{path} ({u.name}, step {u.step_id})")
    for why, paths in by_why.items():
        problems.append(f"{why}, so putting its pre-image back could overwrite someone else's change: "
                        f"{'; '.join(paths)}")
    damaged = [f"{path}: its pre-image {blob} is {why}" for p in plans for blob, path, why in p.damaged]
    if damaged:
        problems.append(f"cannot be restored: {'; '.join(damaged)}")
    if problems:
        raise RecoveryRefused(
            "recovery refused, nothing was changed. " + ". ".join(problems) + ". Check these paths, then "
            "`orchestrator recover --force` overwrites them with their pre-images (a root whose changes cannot be "
            "told apart is put back as snapshotted) and leaves those without a usable pre-image as they are")
