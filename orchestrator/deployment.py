"""What is kept: the one place that records and changes the deployment (the `deployed` table), as Alembic's
HeadMaintainer is for the revisions applied. Each change and the step that records it commit together, so the
history never shows a plugin kept without its outcome, or the other way round.

Nothing is cached here: the table is the only record of what is kept, read again on every question.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.images import same
from orchestrator.journal import Journal
from orchestrator.store import Store, loads


class Deployment:
    def __init__(self, store: Store, journal: Journal):
        self.store = store
        self.journal = journal

    # reading
    def rows(self) -> dict[str, dict]:
        """Kept plugins in the order they were kept: {plugin id: deployed row}."""
        return self.store.deployed()

    def __contains__(self, plugin_id: str) -> bool:
        return plugin_id in self.rows()

    def holds(self, plugin_id: str) -> bool:
        """Kept and in effect: recorded, and every file it changed still holds what the deployment expects."""
        row = self.rows().get(plugin_id)
        return row is not None and not self.drifted(row["step_id"])

    def files(self, step_id: int) -> list[dict]:
        """The paths a step changed (files, symlinks, folders), with their images."""
        return self.store.file_rows(step_id)

    def drifted(self, step_id: int) -> list[str]:
        """Paths of a kept step that no longer hold what the deployment expects (the last kept post-image, mode
        included)."""
        expected: dict[Path, tuple] = {}
        for row in self.rows().values():
            for f in self.files(row["step_id"]):
                expected[self.journal.path(f)] = (f["after"], f["after_mode"])
        return [f["path"] for f in self.files(step_id)
                if not same(self.journal.current(f), expected.get(self.journal.path(f), (f["after"], f["after_mode"])))]

    def clashes(self, step_id: int) -> list[str]:
        """Later kept plugins that changed a file of this step: its pre-images would undo their changes too."""
        order = [row["step_id"] for row in self.rows().values()]
        mine = {self.journal.path(f) for f in self.files(step_id)}
        found = []
        for later in order[order.index(step_id) + 1:] if step_id in order else []:
            shared = sorted(f["path"] for f in self.files(later) if self.journal.path(f) in mine)
            if shared:
                found.append(f"{self.store.step(later)['plugin']} ({', '.join(shared)})")
        return found

    def kept_by(self, run_ids: list[int]) -> list[int]:
        """The steps these runs kept by staging them (not those found already applied) and still kept, in order."""
        deployed = {row["step_id"] for row in self.rows().values()}
        return [s["id"] for run_id in run_ids for s in self.store.steps(run_id)
                if s["kind"] == "attempt" and s["outcome"] == "kept" and s["reason"] != "already_applied"
                and s["id"] in deployed]

    # changing
    def keep(self, plugin_id: str, step_id: int, reason: str | None, detail: str, **fields: Any) -> None:
        """The step's post-images (on disk) become the plugin's record."""
        params = loads(self.store.step(step_id)["params"])
        with self.store.transaction():
            self.store.deploy(plugin_id, step_id, params)
            self.store.finish_step(step_id, "kept", reason, detail, **fields)

    def replace(self, plugin_id: str, row: dict, step_id: int, reason: str, detail: str, **fields: Any) -> None:
        """A re-judged plugin's new step becomes its record, at the old record's place in the order. The new
        step compared the plugin's post-images (its pre) with its pre-images (its post): its rows turn round."""
        with self.store.transaction():
            self.store.swap_images(step_id)
            self.renew(plugin_id, row, step_id, reason, detail, **fields)

    def renew(self, plugin_id: str, row: dict, step_id: int, reason: str, detail: str, **fields: Any) -> None:
        """A newer step, whose rows hold the plugin's images as they are now, becomes its record at the old
        record's place in the order."""
        with self.store.transaction():
            self.store.deploy(plugin_id, step_id, loads(row["params"]), kept_at=row["kept_at"])
            self.store.finish_step(step_id, "kept", reason, detail, **fields)

    def remove(self, plugin_id: str, step_id: int, reason: str, detail: str, **fields: Any) -> None:
        """The plugin is no longer kept; `step_id` is the step that undid it (its files already restored)."""
        with self.store.transaction():
            self.store.undeploy(plugin_id)
            self.store.finish_step(step_id, "rolled_back", reason, detail, **fields)
