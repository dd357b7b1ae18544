"""`orchestrator rollback`: undo kept plugins newest first, refusing to overwrite files changed since."""
from __future__ import annotations

from pathlib import Path

from orchestrator.config import Project
from orchestrator.errors import UserError
from orchestrator.journal import Journal
from orchestrator.plugin import Plugin
from orchestrator.stage import Stager
from orchestrator.steps import StepFailed, undo_step
from orchestrator.store import Store, loads


class Refused(UserError):
    """Rolling back would overwrite someone else's later change."""


def plan_rollback(store: Store, journal: Journal, ids: set[str] | None, force: bool) -> list[dict]:
    """The deployed rows to undo, newest first; checks every file before anything is touched."""
    deployed = store.deployed()
    if ids is not None:
        unknown = sorted(ids - set(deployed))
        if unknown:
            raise Refused(f"not kept in this deployment: {', '.join(unknown)} (kept: {', '.join(deployed) or 'none'})")
    todo = [row for pid, row in reversed(list(deployed.items())) if ids is None or pid in ids]
    if not force:
        problems = conflicts(store, journal, todo)
        if problems:
            raise Refused("files changed since they were kept (use --force to overwrite them): " + "; ".join(problems))
    return todo


def conflicts(store: Store, journal: Journal, todo: list[dict]) -> list[str]:
    """Files that will not hold a plugin's post-image when its turn comes (earlier undos in `todo` counted)."""
    expected: dict[tuple[str, str], str | None] = {}
    problems = []
    for row in todo:
        changed = []
        for f in store.file_rows(row["step_id"]):
            if f["kind"] != "file":
                continue
            key = (f["root_path"], f["path"])
            now = expected[key] if key in expected else journal.current(f)
            if now != f["after"]:
                changed.append(f["path"])
            expected[key] = f["before"]
        if changed:
            problems.append(f"{row['plugin']}: {', '.join(changed)}")
    return problems


def roll_back(store: Store, journal: Journal, project: Project, todo: list[dict], plugins: dict[str, Plugin]) -> list[dict]:
    """Each undo is itself journaled: a crash half-way is recovered back to the kept state."""
    run_id = store.start_run("rollback", str(project.source or "<embedded default>"), project.target.kind)
    stager = Stager(project, [], store, journal)
    stager.run_id = run_id
    for row in todo:
        kept_step = row["step_id"]
        step_id = store.new_step(run_id, row["plugin"], "rolling_back", params=loads(row["params"]))
        for f in store.file_rows(kept_step):
            if f["kind"] == "file":
                journal.track(step_id, f["root"], Path(f["root_path"]), f["path"])
        journal.show(kept_step, "pre")
        plugin = plugins.get(row["plugin"])
        if plugin:
            params = loads(row["params"]) or {}
            variant = next((v for v in plugin.variants if v.params == params), plugin.variants[0])
            ctx = stager.context(plugin, step_id)
            for step in reversed(variant.rollback):
                if step.runs_on(project.target.kind):
                    try:
                        undo_step(step, ctx)
                    except StepFailed as e:
                        store.event(run_id, "rollback_step_failed", f"{row['plugin']}: {e}", step_id)
        else:
            store.event(run_id, "warning", f"{row['plugin']}: plugin folder gone; only files restored", step_id)
        with store.transaction():
            store.undeploy(row["plugin"])
            store.finish_step(step_id, "rolled_back", "requested", f"undid step {kept_step} "
                                                                   f"(run {store.step(kept_step)['run_id']})")
    store.finish_run(run_id, "finished")
    return todo
