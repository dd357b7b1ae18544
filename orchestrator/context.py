"""One command's run as its processes see it: the environment they start with, where they are recorded, and the
plugin's own rollback steps run in it. Staging, re-measurement and `rollback` share it."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.config import Project
from orchestrator.journal import Journal
from orchestrator.plugin import Plugin
from orchestrator.steps import StepContext, StepFailed, undo_step
from orchestrator.store import Store


class Reporter:
    """Progress callbacks for the CLI; the default reports nothing."""

    def phase(self, plugin: str, phase: str) -> None: ...
    def tick(self, elapsed: float, tail: str) -> None: ...
    def outcome(self, plugin: str, outcome: str, reason: str | None, gain: float | None) -> None: ...


@dataclass
class ProcessRow:
    """A recorded process (its row in the processes table); calling it records that the process ended."""
    store: Store
    id: int

    def __call__(self) -> None:
        self.store.end_process(self.id)


@dataclass
class RunContext:
    project: Project
    store: Store
    journal: Journal
    run_id: int
    reporter: Reporter = field(default_factory=Reporter)
    # how this run pairs samples: the target's way (Target.pairing), until the run finds that a woken server does
    # not measure like a fresh one and restarts servers instead (loop.py)
    pairing: str = "sequential"
    # the live servers of the "sleeping" pairing, one awake at a time (state_server.py)
    sleepers: list = field(default_factory=list)
    # a screening worker's partner in a duet (pairing.Duet): it samples the arm this worker does not
    partner: Any = None

    @property
    def kind(self) -> str:
        return self.project.target.kind

    @property
    def tmp(self) -> Path:
        """Output files of running processes; removed at the start of a command, so a crash leaves none for long."""
        return self.project.state_dir / "tmp"

    def env(self, plugin: str) -> dict[str, str]:
        roots = self.project.target.roots
        env = {**os.environ, **self.project.target.env(),
               "ORCHESTRATOR_TARGET_ROOT": str(next(iter(roots.values()))),
               "ORCHESTRATOR_RUN_ID": str(self.run_id), "ORCHESTRATOR_PLUGIN": plugin}
        for name, path in roots.items():
            env[f"ORCHESTRATOR_ROOT_{re.sub(r'[^A-Za-z0-9]', '_', name).upper()}"] = str(path)
        return env

    def tick(self, elapsed: float, tail: str) -> None:
        """While a process runs: progress for the reporter."""
        self.reporter.tick(elapsed, tail)

    def recorder(self, step_id: int | None):
        """`on_start` for run_process: records the process so that recovery can kill what a crash leaves; it
        returns the row, which ends the record when called."""
        def on_start(what: str, pid: int, create_time: float) -> ProcessRow:
            return ProcessRow(self.store, self.store.add_process(self.run_id, step_id, what, pid, pid, create_time))
        return on_start

    def context(self, plugin: Plugin, step_id: int | None) -> StepContext:
        return StepContext(self.project.target.roots, self.kind, plugin.folder, self.env(plugin.id), self.journal,
                           step_id, on_start=self.recorder(step_id), on_tick=self.tick, tmp_dir=self.tmp)

    def undo_steps(self, plugin: Plugin, params: dict[str, Any] | None, step_id: int) -> None:
        """The plugin's own rollback steps (of the variant with these params), in reverse, after its files were
        restored; a failure is recorded as an event and the rest still run."""
        variant = next((v for v in plugin.variants if v.params == (params or {})), plugin.variants[0])
        ctx = self.context(plugin, step_id)
        for step in reversed(variant.rollback):
            if step.runs_on(self.kind):
                try:
                    undo_step(step, ctx)
                except StepFailed as e:
                    self.store.event(self.run_id, "rollback_step_failed", f"{plugin.id}: {e}", step_id)


def open_run(project: Project, store: Store, journal: Journal, command: str,
             reporter: Reporter | None = None) -> RunContext:
    """Record a new run of `command` (`run`, `rollback`) and return its context."""
    run_id = store.start_run(command, str(project.source or "<embedded default>"), project.target.kind)
    run = RunContext(project, store, journal, run_id, reporter or Reporter(), project.target.pairing())
    run.tmp.mkdir(parents=True, exist_ok=True)
    return run
