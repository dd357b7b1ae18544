"""Screening on workers: a run with `workers` > 1 measures independent candidates at the same time.

Independent are the params combinations of one plugin and consecutive plugins none of which requires or comes after
another (in the plan's order). While the target holds the last kept state and the run's own servers are stopped,
each such candidate goes to a worker (workers.py) with a GPU of its own, which stages it on its own copy of the kept
state (sandbox.py) and gives back what it measured. The run alone records it: a candidate a worker rolled back is
rolled back (a step of kind `screening`), and what a worker would keep is then staged on the target, in the
plugins' order, through the normal path (stage.py), since effects can interact: the best params combination first,
the next only where it is not kept.

A worker whose environment fails under a candidate (it dies, or the kept state fails its probe there too) gives that
candidate `environment_failed`; the probe is re-checked on the kept state on another worker (the control, or on the
target where no worker is left): where it passes, the worker takes no more candidates and the candidate is staged on
the target; where it fails too, the run stops as it would without workers.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator.decide import Decision
from orchestrator.plugin import Plugin, Variant
from orchestrator.prober import EnvironmentFailed, failure
from orchestrator.sandbox import SCREENING, Checked, Job, Screened, recorded
from orchestrator.stage import Stager, describe
from orchestrator.store import dumps, loads

# A step's fields a worker's record gives the run's.
COPIED = ("gain", "before_value", "after_value", "metrics", "baseline_metrics", "control", "started")


def independent(plugins: list[Plugin]) -> list[list[Plugin]]:
    """Runs of consecutive plugins none of which requires or comes after another of its run."""
    groups: list[list[Plugin]] = []
    ids: set[str] = set()
    for plugin in plugins:
        if groups and not ids & {*plugin.manifest.requires, *plugin.manifest.after}:
            groups[-1].append(plugin)
        else:
            groups.append([plugin])
            ids = set()
        ids.add(plugin.id)
    return groups


@dataclass
class Found:
    """What screening found of one plugin: the combinations a worker would keep (open steps, best first once
    sorted) and those no worker could judge, which the target then stages."""
    passed: list[tuple[float, Variant, int, float]] = field(default_factory=list)  # (gain, variant, step, ended)
    unscreened: list[Variant] = field(default_factory=list)


class Screening:
    """A run's screening: the loop's stager stages on the target what the pool's workers find."""

    def __init__(self, stager: Stager, pool: Any, plugins: list[Plugin]):
        self.stager = stager
        self.run = stager.run
        self.store = stager.store
        self.pool = pool
        self.plugins = plugins
        self.jobs = 0

    def stage(self, plugins: list[Plugin], earlier: dict[str, list[dict]]) -> None:
        """Stage these plugins in order, screening each group of independent candidates on the workers."""
        shutil.rmtree(self.run.project.state_dir / SCREENING, ignore_errors=True)
        for group in independent(plugins):
            ready = []
            for plugin in group:
                if plugin.id in earlier:
                    self.stager.decided_earlier(plugin, earlier[plugin.id])
                elif self.stager.checked(plugin):
                    ready.append(plugin)
            jobs = [self.job(p, v) for p in ready for v in p.variants]
            if len(jobs) < 2:  # nothing to measure at the same time: screening would only add a confirmation
                for plugin in ready:
                    self.stager.choose(plugin, plugin.variants)
                continue
            started, workers, self.busy = time.time(), self.pool.size, 0.0
            found: dict[str, Found] = {p.id: Found() for p in ready}
            try:
                self.screen(jobs, found)
                for plugin in ready:
                    self.confirm(plugin, found[plugin.id])
            except EnvironmentFailed:
                self.close(found, "not staged on the target: the run stopped")
                raise
            finally:
                self.store.add_screening(self.run.run_id, workers, len(jobs), started, self.busy)
                shutil.rmtree(self.run.project.state_dir / SCREENING, ignore_errors=True)  # all of it is recorded

    def job(self, plugin: Plugin, variant: Variant) -> Job:
        self.jobs += 1
        kept = self.stager.kept
        return Job(f"r{self.run.run_id}-{self.jobs}", self.run.project, self.plugins, plugin.id, variant.params,
                   self.stager.deployment.rows(), kept.configuration, list(kept.judged), self.stager.noise,
                   self.run.pairing, dict(os.environ))

    def screen(self, jobs: list[Job], found: dict[str, Found]) -> None:
        """Every job on the workers, each result recorded as it comes into `found`; `busy` adds up the seconds one
        worker would have taken."""
        self.stager.kept.release()  # the devices are the workers' while they screen
        self.stager.prober.release()
        lost: dict[str, int] = {}  # job key: its screening step, failed, awaiting its control
        controls: list[tuple[Job, list[str]]] = []  # to run on the target once no worker is left
        self.run.reporter.phase(f"{len(jobs)} candidates", f"screening on {self.pool.size} workers")
        for job in jobs:
            self.pool.submit(job)
        try:
            while self.pool.pending():
                job, probes, slot, result = self.pool.next(lambda elapsed: self.run.tick(elapsed, ""))
                if probes is not None:  # a control
                    if isinstance(result, Checked):
                        self.controlled(job, lost.pop(job.key), result, found[job.plugin_id])
                    else:  # its worker failed too: on yet another
                        self.check(job, probes, slot, controls)
                    continue
                self.busy += getattr(result, "busy", 0.0)
                step_id = self.record(job, getattr(result, "worker", slot), result)
                if isinstance(result, Screened) and result.failed is None:
                    if result.passed:
                        found[job.plugin_id].passed.append((result.step["gain"] or 0.0, job.variant, step_id,
                                                            time.time()))
                    continue
                lost[job.key] = step_id
                self.check(job, getattr(result, "probes", []), slot, controls)
            for job, probes in self.pool.stranded():  # no worker is left to run them
                if probes is None:
                    found[job.plugin_id].unscreened.append(job.variant)
                else:
                    controls.append((job, probes))
        except BaseException:
            self.pool.cancel()
            raise
        for job, probes in controls:  # on the target, which holds the kept state
            self.controlled(job, lost[job.key], self.on_target(job, probes, lost[job.key]), found[job.plugin_id])

    def check(self, job: Job, probes: list[str], failed: str, controls: list[tuple[Job, list[str]]]) -> None:
        """The control of a candidate whose worker (`failed`) failed: on another worker, else on the target."""
        if self.pool.others(failed):
            self.pool.submit(job, probes, avoid=failed)
        else:
            controls.append((job, probes))

    def record(self, job: Job, worker: str, result: Any) -> int:
        """A worker's result as a step of kind `screening`, with what it measured: finished where the worker rolled
        the candidate back or failed under it, open (`screened`) where it would keep it."""
        screened = isinstance(result, Screened)
        failed = result.failed if screened else result.why
        passed = screened and result.passed
        if screened:
            step, parts = result.step, [(worker, result.rows), *([result.partner] if result.partner else [])]
        else:  # what a worker that died had recorded is on disk
            step, rows = recorded(job.folder())
            parts = [(worker, rows), (worker, recorded(job.folder("partner"))[1])]
        step_id = self.store.new_step(self.run.run_id, job.plugin_id, "screened" if passed else "done",
                                      params=job.params, kind="screening", objective=(step or {}).get("objective"))
        with self.store.transaction():
            for who, rows in parts:
                if rows:
                    self.store.add_measured(self.run.run_id, step_id, who, **rows)
            self.store.set_step(step_id, **{k: step[k] for k in COPIED if step and step.get(k) is not None})
            if failed is not None:
                self.store.finish_step(step_id, "rolled_back", "environment_failed",
                                       f"the worker {worker} failed under it: {failed}; its probe is checked on the "
                                       "kept state elsewhere (control)")
            elif passed:
                decision = Decision(**loads(result.rows["decisions"][-1]["decision"])) if result.rows["decisions"] \
                    else None
                self.store.set_step(step_id, reason=step["reason"], detail=(describe(decision) if decision else
                                    "no throughput probe configured") + f" (screened on {worker})")
            else:
                self.store.finish_step(step_id, step["outcome"], step["reason"],
                                       f"{step['detail']} (screened on {worker})", finished=step["finished"])
        name = f"{job.name} on {worker}"
        if failed is not None:
            self.run.reporter.outcome(name, "rolled_back", "environment_failed", None)
        elif passed:
            self.run.reporter.outcome(name, "screened", step["reason"], step["gain"])
        else:
            self.stager.kept.remember(result.read, job.name, step_id, step["reason"])
            self.run.reporter.outcome(name, step["outcome"], step["reason"], step["gain"])
        return step_id

    def controlled(self, job: Job, step_id: int, check: Checked, found: Found) -> None:
        """The control of a candidate whose worker failed: passed, the candidate is staged on the target; failed,
        the environment is at fault and the run stops."""
        if check.rows:
            self.store.add_measured(self.run.run_id, step_id, check.worker, **check.rows)
        self.store.set_step(step_id, control=dumps({"probe": check.probe, "passed": check.passed, "reason": None,
                                                    "detail": check.detail, "worker": check.worker}))
        if check.passed:
            found.unscreened.append(job.variant)
            return
        raise EnvironmentFailed(f"{job.name}: its worker failed under it, and probe {check.probe} fails on the kept "
                                f"state on {check.worker} too ({check.detail}); nothing more staged: fix the "
                                f"environment, then `orchestrator run` continues from {job.plugin_id}")

    def on_target(self, job: Job, probes: list[str], step_id: int) -> Checked:
        """The control where no worker is left: the probes on the target's kept state, recorded on the step."""
        prober = self.stager.prober
        specs = [s for s in [*prober.correctness, *prober.throughput] if not probes or s.name in probes]
        try:
            for spec in specs:
                out = prober.probe(spec, step_id, self.stager.kept.arm, "control", 0, f"(control of {job.name})")
                if not out.ok:
                    return Checked("the target", False, spec.name, failure(out), {})
        finally:
            prober.release()
        return Checked("the target", True, ", ".join(s.name for s in specs), "passed", {})

    def confirm(self, plugin: Plugin, found: Found) -> None:
        """Stage on the target what screening found: the combinations a worker would keep, best first, until one is
        kept (the rest are then outperformed), with those no worker could judge."""
        if not (found.passed or found.unscreened):
            return
        if not self.stager.checked(plugin):  # a plugin kept meanwhile changed what this one needs
            return self.close({plugin.id: found}, "not staged on the target: the plugin is skipped there (its step "
                              "says why)", "measured", "screened")
        found.passed.sort(key=lambda p: p[0], reverse=True)
        kept = None
        while kept is None and (found.passed or found.unscreened):
            head = found.passed[:1]
            del found.passed[:1]
            for _, _, step_id, ended in head:
                self.store.finish_step(step_id, "measured", "screened", self.store.step(step_id)["detail"] +
                                       "; staged on the target next", finished=ended)
            kept = self.stager.choose(plugin, [v for _, v, _, _ in head] + found.unscreened)
            found.unscreened = []
        for gain, _, step_id, ended in found.passed:
            self.stager.outperformed(plugin, step_id, kept, gain, finished=ended)
        found.passed = []

    def close(self, found: dict[str, Found], why: str, outcome: str = "rolled_back",
              reason: str = "environment_failed") -> None:
        """Screened steps left unstaged (the run stops on an environment failure, or the plugin is skipped)."""
        for f in found.values():
            for _, _, step_id, ended in f.passed:
                detail = self.store.step(step_id)["detail"]
                self.store.finish_step(step_id, outcome, reason, f"{detail}; {why}", finished=ended)
            f.passed = []
