"""`orchestrator plan`: the staging order, preconditions and the diff each plugin would make; writes nothing."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.config import Project
from orchestrator.plugin import Plugin
from orchestrator.steps import FILE_CHECKS, PROCESS_KINDS, StepContext, StepFailed, check, compute_all, read_disk


@dataclass
class PlanItem:
    plugin: Plugin
    notes: list[str] = field(default_factory=list)
    diffs: list[str] = field(default_factory=list)
    skipped: str | None = None


def build_plan(project: Project, plugins: list[Plugin], kept: set[str] = frozenset()) -> list[PlanItem]:
    """Simulate every plugin in order as if each were kept, on an in-memory overlay of the target."""
    target = project.target
    overlay: dict[Path, bytes | None] = {}

    def read(p: Path) -> bytes | None:
        return overlay[p] if p in overlay else read_disk(p)

    items, would_keep = [], set(kept)
    for plugin in plugins:
        item = PlanItem(plugin)
        items.append(item)
        m = plugin.manifest
        if m.requires:
            item.notes.append(f"requires {', '.join(m.requires)}")
        if target.kind not in m.targets:
            item.skipped = f"not_applicable (targets: {', '.join(m.targets)})"
            continue
        missing = [r for r in m.requires if r not in would_keep]
        if missing:
            item.skipped = f"dependency_not_kept ({', '.join(missing)} unknown or not applicable)"
            continue
        ctx = StepContext(target.roots, target.kind, plugin.folder, {})
        variant = plugin.variants[0]
        if len(plugin.variants) > 1:
            item.notes.append(f"{len(plugin.variants)} parameter combinations; diff shown for {variant.label}")
        unmet = None
        for chk in variant.applies_if:
            if not chk.runs_on(target.kind):
                continue
            if chk.kind in FILE_CHECKS:
                ok, why = check(chk, ctx, read)
                item.notes.append(("met: " if ok else "unmet: ") + why)
                unmet = unmet or (None if ok else why)
            else:
                item.notes.append(f"{chk.kind} precondition checked at run time")
        if unmet:
            item.skipped = f"not_applicable ({unmet})"
            continue
        steps = [step for step in variant.apply if step.runs_on(target.kind)]
        for step in steps:
            if step.kind in PROCESS_KINDS:
                what = " ".join(step.body.run) if step.kind == "command" else f"hooks.{step.body.function}()"
                item.notes.append(f"runs {what} (its changes are known only at run time)")
        try:
            changes = compute_all([s for s in steps if s.kind not in PROCESS_KINDS], ctx, read)
        except StepFailed as e:
            item.skipped = f"apply would fail: {e}"
            continue
        overlay.update({full: new for full, (_, _, _, new) in changes.items()})
        would_keep.add(plugin.id)
        for full, (_, _, old, new) in changes.items():
            rel = _rel(full, target.roots)
            if old == new:
                continue
            try:
                a, b = (old or b"").decode("utf-8").splitlines(True), new.decode("utf-8").splitlines(True)
            except UnicodeDecodeError:
                item.diffs.append(f"binary file {rel} changes\n")
                continue
            item.diffs.append("".join(difflib.unified_diff(a, b, "/dev/null" if old is None else f"a/{rel}", f"b/{rel}")))
    return items


def _rel(path: Path, roots: dict[str, Path]) -> str:
    for name, root in roots.items():
        if path.is_relative_to(root):
            rel = str(path.relative_to(root))
            return rel if name == next(iter(roots)) else f"{name}:{rel}"
    return str(path)
