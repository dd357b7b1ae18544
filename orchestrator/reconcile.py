"""Kept plugins whose files someone changed since they were kept, settled before a run measures anything, so that
the history always says what the target holds.

The stack is taken apart newest first, as a rollback would: for each kept plugin, what its paths hold with the
plugins kept after it taken off (`held`), and what they would hold without its change too (`without`): its
pre-image where a path still holds its post-image, else the later edit with its change taken out by a three-way
merge. Its change is still in place when its steps, applied again to `without`, give back `held` exactly: it
stays kept, and its record becomes (`without`, `held`), so that a rollback undoes its change and keeps the edit.
Otherwise it is undone for real (with every later plugin that shares a path with it or requires it), as far as
its change can be told apart from the edit (the rest is left as it is, and said), and staged again.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from merge3 import Merge3

from orchestrator.context import RunContext
from orchestrator.deployment import Deployment
from orchestrator.images import Image, is_blob, same
from orchestrator.plugin import Plugin, Variant
from orchestrator.steps import PROCESS_KINDS, StepFailed, compute, read_disk
from orchestrator.store import loads

Key = tuple[str, str]  # (root name, path inside the root), as the history names a path


def key(row: dict) -> Key:
    return row["root"], row["path"]


@dataclass
class Unstacked:
    """One kept plugin taken off the stack as it stands."""

    plugin: str
    row: dict  # its `deployed` row
    files: list[dict]  # its record: the paths it changed, with their pre- and post-images
    held: dict[Key, Image]  # what its paths hold with the plugins kept after it taken off
    without: dict[Key, Image]  # and with its own change taken off too
    tangled: list[str] = field(default_factory=list)  # paths where its change cannot be told apart from an edit
    in_place: bool = True

    @property
    def changed(self) -> list[str]:
        """Its paths that hold something other than its recorded post-images."""
        return [f["path"] for f in self.files if not same(self.held[key(f)], (f["after"], f["after_mode"]))]


class Reconciler:
    def __init__(self, run: RunContext, deployment: Deployment, plugins: list[Plugin], staged: set[str]):
        self.run, self.deployment, self.journal, self.store = run, deployment, run.journal, run.store
        self.plugins = {p.id: p for p in plugins}
        self.staged = staged  # the plugins this run stages
        self.data: dict[str, bytes] = {}  # the bytes of images made here (merges), by their hash

    def settle(self) -> dict[str, Unstacked]:
        """Undo for real what is no longer in place; return the plugins still in place whose records must take
        the later edits in (`Stager.already_applied` does that at their turn), by id."""
        stack = self.unstack()
        if not any(u.changed for u in stack):
            return {}
        undo = self.to_undo(stack[::-1])
        for u in stack:
            if u.plugin in undo:
                self.undo(u)
        return {u.plugin: u for u in stack if u.plugin not in undo and u.changed}

    def unstack(self) -> list[Unstacked]:
        """The kept plugins, newest first, each taken off the stack left by those after it."""
        view: dict[Key, Image] = {}
        out = []
        for plugin_id, row in reversed(list(self.deployment.rows().items())):
            files = self.deployment.files(row["step_id"])
            held = {key(f): view[key(f)] if key(f) in view else self.journal.keep(self.journal.path(f)) for f in files}
            u = Unstacked(plugin_id, row, files, held, {})
            for f in files:
                now = held[key(f)]
                if same(now, (f["after"], f["after_mode"])):
                    u.without[key(f)] = (f["before"], f["before_mode"])
                elif (merged := self.merge(f, now)) is not None:
                    u.without[key(f)] = merged
                else:
                    u.without[key(f)] = now
                    u.tangled.append(f["path"])
            u.in_place = not u.changed or (not u.tangled and self.replays(u))
            view.update(u.without)
            out.append(u)
        return out

    def to_undo(self, stack: list[Unstacked]) -> set[str]:
        """The oldest plugin no longer in place, and every later one that shares a path with those undone or
        requires one of them (oldest first in `stack`)."""
        first = next((i for i, u in enumerate(stack) if not u.in_place), None)
        if first is None:
            return set()
        undo, paths = set(), set()
        for u in stack[first:]:
            plugin = self.plugins.get(u.plugin)
            requires = set(plugin.manifest.requires) if plugin else set()
            if not undo or paths & set(u.held) or requires & undo:
                undo.add(u.plugin)
                paths |= set(u.held)
        return undo

    def merge(self, row: dict, now: Image) -> Image | None:
        """`now` with the plugin's change (its pre-image to its post-image) taken out: of the bytes, where all three
        are UTF-8 text and the edits since do not touch the lines it changed; of the mode, where the edit and the
        plugin did not both change it. None where it cannot be told apart."""
        if not (is_blob(row["before"]) and is_blob(row["after"]) and is_blob(now[0])):
            return None
        modes = {now[1], row["before_mode"]} - {row["after_mode"]}
        if len(modes) > 1:
            return None
        mode = modes.pop() if modes else row["before_mode"]
        if now[0] == row["after"]:
            return row["before"], mode
        try:
            before, after, current = (self.bytes_of(i).decode("utf-8").splitlines(True)
                                      for i in (row["before"], row["after"], now[0]))
        except UnicodeDecodeError:
            return None
        merge = Merge3(after, current, before)
        if any(group[0] == "conflict" for group in merge.merge_groups()):
            return None
        data = "".join(merge.merge_lines()).encode("utf-8")
        digest = hashlib.sha256(data).hexdigest()
        self.data[digest] = data
        return digest, mode

    def replays(self, u: Unstacked) -> bool:
        """Whether the plugin's steps (of its kept params), applied to `without`, give `held` exactly; only
        declarative steps can be replayed without running anything."""
        plugin = self.plugins.get(u.plugin)
        variant = self.variant(plugin, u.row) if plugin else None
        if variant is None:
            return False
        steps = [s for s in variant.apply if s.runs_on(self.run.kind)]
        if any(s.kind in PROCESS_KINDS for s in steps):
            return False
        paths = {self.journal.path(f): key(f) for f in u.files}
        overlay: dict[Path, bytes | None] = {}
        for path, k in paths.items():
            if u.without[k][0] is not None and not is_blob(u.without[k][0]):
                return False  # a symlink or a folder: declarative steps write files only
            overlay[path] = self.bytes_of(u.without[k][0])
        ctx = self.run.context(plugin, None)
        try:
            for step in steps:
                _, _, full, data = compute(step, ctx, lambda p: overlay[p] if p in overlay else read_disk(p))
                if full not in paths:
                    return False
                overlay[full] = data
        except StepFailed:
            return False
        for path, k in paths.items():
            (held, held_mode), (_, mode) = u.held[k], u.without[k]
            if not (held is None or is_blob(held)) or overlay[path] != self.bytes_of(held):
                return False
            if held is not None and mode is not None and held_mode != mode:  # steps keep a file's mode
                return False
        return True

    @staticmethod
    def variant(plugin: Plugin, row: dict) -> Variant | None:
        params = loads(row["params"]) or {}
        return next((v for v in plugin.variants if v.params == params), None)

    def bytes_of(self, image: str | None) -> bytes | None:
        if image is None:
            return None
        return self.data[image] if image in self.data else self.journal.blob(image)

    def store_images(self, images: list[str | None]) -> None:
        """Blobs of the images made here, before a row or a write names them."""
        for image in images:
            if image in self.data:
                self.journal.put_bytes(self.data[image])

    def undo(self, u: Unstacked) -> None:
        """Take the plugin's change off the target where it can be told apart from later edits, run its own
        rollback steps, and record it no longer kept; journaled as a rollback, so a crash half-way is recovered to
        the state before it."""
        params = loads(u.row["params"])
        step_id = self.store.new_step(self.run.run_id, u.plugin, "rolling_back", params=params, kind="rollback")
        self.journal.track_images(step_id, [(*key(f), *u.without[key(f)]) for f in u.files])
        moved = [(self.journal.path(f), *u.without[key(f)]) for f in u.files
                 if not same(u.held[key(f)], u.without[key(f)])]
        self.store_images([image for _, image, _ in moved])
        self.journal.put(moved)
        plugin = self.plugins.get(u.plugin)
        if plugin is not None:
            self.run.undo_steps(plugin, params, step_id)
        original = self.store.step(u.row["step_id"])
        changed = ", ".join(u.changed) or "nothing of its own"
        detail = (f"kept in run {original['run_id']}; {changed} changed since, and its change is no longer in place "
                  "as it would make it: undone")
        if u.tangled:
            detail += (f"; left as it is (its change cannot be told apart from the later edit there): "
                       f"{', '.join(u.tangled)}")
        detail += ("; staged again" if u.plugin in self.staged else "; the next run stages it again"
                   if plugin is not None else "; its plugin folder is gone")
        self.deployment.remove(u.plugin, step_id, "changed_since", detail)
        self.run.reporter.outcome(u.plugin, "rolled_back", "changed_since", None)

    def renew(self, u: Unstacked, step_id: int) -> None:
        """Record (`without`, `held`) as the plugin's images on `step_id`, which becomes its record."""
        self.store_images([image for k in u.held for image in (u.without[k][0], u.held[k][0])])
        self.journal.record(step_id, [dict(step_id=step_id, root=f["root"], path=f["path"],
                                           before=u.without[key(f)][0], before_mode=u.without[key(f)][1],
                                           after=u.held[key(f)][0], after_mode=u.held[key(f)][1], sealed=1)
                                      for f in u.files])
