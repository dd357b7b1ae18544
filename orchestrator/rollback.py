"""`orchestrator rollback`: undo kept plugins newest first, refusing to overwrite files changed since."""
from __future__ import annotations

from pathlib import Path

from orchestrator.config import Project
from orchestrator.context import open_run
from orchestrator.deployment import Deployment
from orchestrator.errors import UserError
from orchestrator.images import DIR, is_blob, same, walk
from orchestrator.journal import Journal
from orchestrator.plugin import Plugin
from orchestrator.store import Store, loads


class Refused(UserError):
    """Rolling back would overwrite someone else's later change."""


def plan_rollback(store: Store, journal: Journal, ids: set[str] | None, force: bool,
                  plugins: dict[str, Plugin] | None = None) -> list[dict]:
    """The deployed rows to undo, newest first; checks every file before anything is touched. A kept plugin
    that `requires` one being rolled back must be rolled back with it."""
    deployed = store.deployed()
    if ids is not None:
        unknown = sorted(ids - set(deployed))
        if unknown:
            raise Refused(f"not kept in this deployment: {', '.join(unknown)} (kept: {', '.join(deployed) or 'none'})")
        needing = {pid: sorted(set(plugins[pid].manifest.requires) & ids) for pid in deployed
                   if pid not in ids and pid in (plugins or {})}
        left = {pid: needs for pid, needs in needing.items() if needs}
        if left:
            names = " ".join(sorted(ids | set(left)))
            raise Refused("kept plugins require what would be rolled back: " + "; ".join(
                f"{pid} requires {', '.join(needs)}" for pid, needs in sorted(left.items())) +
                f". Roll them back together (`orchestrator rollback {names}`) or use --all")
    todo = [row for pid, row in reversed(list(deployed.items())) if ids is None or pid in ids]
    for row in todo:  # a path outside the target is refused before anything is written
        journal.check_paths([(journal.path(f), f["before"], f["before_mode"]) for f in store.file_rows(row["step_id"])])
    journal.check_blobs([(f["before"], journal.path(f)) for row in todo for f in store.file_rows(row["step_id"])
                         if is_blob(f["before"])])  # a damaged pre-image is refused before anything is written
    if not force:
        problems = conflicts(store, journal, todo)
        if problems:
            raise Refused("files changed since they were kept (use --force to overwrite them): " + "; ".join(problems))
    return todo


def conflicts(store: Store, journal: Journal, todo: list[dict]) -> list[str]:
    """Paths that will not hold a plugin's post-image (mode included) when its turn comes (earlier undos in
    `todo` counted), and what lies in a folder a plugin made that none of them recorded: removing the folder
    would delete it."""
    rows = {row["plugin"]: store.file_rows(row["step_id"]) for row in todo}
    recorded = {journal.path(f) for files in rows.values() for f in files}
    expected: dict[Path, tuple] = {}
    problems = []
    for row in todo:
        changed = []
        for f in rows[row["plugin"]]:
            key = journal.path(f)
            now = expected[key] if key in expected else journal.current(f)
            if not same(now, (f["after"], f["after_mode"])):
                changed.append(f["path"])
            elif f["after"] == DIR and f["before"] is None:
                changed += [f"{Path(f['path']) / rel} (in a folder it made)" for rel, path, _ in walk(key)
                            if path not in recorded]
            expected[key] = (f["before"], f["before_mode"])
        if changed:
            problems.append(f"{row['plugin']}: {', '.join(changed)}")
    return problems


def roll_back(store: Store, journal: Journal, project: Project, todo: list[dict], plugins: dict[str, Plugin]) -> list[dict]:
    """Each undo is itself journaled: a crash half-way is recovered back to the kept state."""
    run = open_run(project, store, journal, "rollback")
    deployment = Deployment(store, journal)
    for row in todo:
        kept_step = row["step_id"]
        params = loads(row["params"])
        step_id = store.new_step(run.run_id, row["plugin"], "rolling_back", params=params, kind="rollback")
        journal.track_images(step_id, [(f["root"], f["path"], f["before"], f["before_mode"])
                                       for f in deployment.files(kept_step)])
        journal.show(kept_step, "pre")
        plugin = plugins.get(row["plugin"])
        if plugin:
            run.undo_steps(plugin, params, step_id)
        else:
            store.event(run.run_id, "warning", f"{row['plugin']}: plugin folder gone; only files restored", step_id)
        deployment.remove(row["plugin"], step_id, "requested",
                          f"undid step {kept_step} (run {store.step(kept_step)['run_id']})")
    store.finish_run(run.run_id, "finished")
    journal.settle()
    return todo
