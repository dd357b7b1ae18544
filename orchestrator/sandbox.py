"""A candidate screened in a folder of its own, as a screening worker runs it (workers.py).

The folder holds copies of the roots the candidate's steps may change, taken from the target while the run keeps
its last kept state there, and a history, blobs and temporary files of its own. In it the candidate is staged by
the same code as on the target (stage.py): applied by its steps, verified, probed and measured in pairs against the
copy of the kept state, on servers started there. What it measured goes back as rows, which the run records
(screening.py): nothing here opens the run's history or journal, or writes to its target. No Ray here.
"""
from __future__ import annotations

import os
import shutil
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from orchestrator.config import Project
from orchestrator.context import open_run
from orchestrator.deployment import Deployment
from orchestrator.journal import Journal
from orchestrator.kept import KeptState
from orchestrator.noise import Noise
from orchestrator.pairing import Side
from orchestrator.plugin import Plugin, Variant
from orchestrator.prober import Arm, ArmFailed, EnvironmentFailed, Prober, Sample, failure
from orchestrator.probes.marks import MARK, new_mark, scoped
from orchestrator.stage import Stager, plugins_own
from orchestrator.steps import apply_all
from orchestrator.store import Reader, Store, loads

# What Ray sets for a worker's devices: never taken from the run's environment.
DEVICES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
SCREENING = "screening"  # the workers' folders, in the run's state folder


@dataclass
class Job:
    """One candidate to screen, sent to a worker whole (pickled)."""
    key: str  # unique in the run: names its folder
    project: Project  # the run's
    plugins: list[Plugin]  # every plugin (the probed states' numerics)
    plugin_id: str
    params: dict[str, Any]
    kept: dict[str, dict]  # the deployed rows: what the kept state holds
    configuration: dict | None  # what the configuration probes read on the kept state
    judged: list  # candidates rolled back since the last keep (KeptState.judged)
    noise: Noise | None
    pairing: str  # the run's
    env: dict[str, str]  # the run's environment
    mark: str = field(default_factory=new_mark)  # every process it starts carries it (a dead worker's are swept)

    @property
    def plugin(self) -> Plugin:
        return next(p for p in self.plugins if p.id == self.plugin_id)

    @property
    def variant(self) -> Variant:
        return next(v for v in self.plugin.variants if v.params == self.params)

    @property
    def name(self) -> str:
        return self.plugin_id + (f" [{self.variant.label}]" if self.params else "")

    def folder(self, role: str = "leader") -> Path:
        """Where a worker of the job works (a duet has two: the leader judges, its partner samples)."""
        return self.project.state_dir / SCREENING / self.key / role


@dataclass
class Screened:
    """What a worker found: its step as its own history holds it, the rows to record with it, and the seconds one
    worker spends on it. `failed`: the worker's environment failed under it (its control failed too, or its partner
    died); `probes` then names what to re-check elsewhere."""
    key: str
    worker: str
    step: dict
    rows: dict[str, list[dict]]
    read: dict | None = None  # the configuration probes' readings on the candidate
    busy: float = 0.0
    failed: str | None = None
    probes: list[str] = field(default_factory=list)
    partner: tuple[str, dict[str, list[dict]]] | None = None  # a duet's other worker and what it recorded

    @property
    def passed(self) -> bool:
        """The worker would keep it: the run stages it on the target (screening.py)."""
        return self.failed is None and self.step["state"] == "candidate"


@dataclass
class Checked:
    """A control: the probes a failed candidate was re-checked with, on the kept state in a worker's own copy."""
    worker: str
    passed: bool
    probe: str  # the probe that failed, or those that passed
    detail: str
    rows: dict[str, list[dict]]


def recorded(folder: Path) -> tuple[dict | None, dict[str, list[dict]]]:
    """The step a worker's history in `folder` holds and what it recorded of it, read only (a worker that died)."""
    db = folder / "state" / "orchestrator.db"
    if not db.exists():
        return None, {}
    reader = Reader(db)
    try:
        steps = [s for r in reader.runs() for s in reader.steps(r["id"])]
        return (steps[-1] if steps else None), reader.recorded()
    finally:
        reader.close()


@contextmanager
def working(job: Job) -> Iterator[None]:
    """The worker's process set up for the job: the run's environment (its devices are Ray's), and the run's state
    folder's marks on every process it starts (`job.mark` too), so that the run's `recover` finds them."""
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in job.env.items() if k not in DEVICES})
    os.environ[MARK] = job.mark
    try:
        with scoped(job.project.state_dir):
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class Copy:
    """A worker's folder: copies of the roots the candidate's steps may change, its own history, a run in it, and
    the kept state as the run keeps it."""

    def __init__(self, job: Job, folder: Path):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        target = job.project.target
        roots, first, variant = target.roots, next(iter(target.roots)), job.variant
        named = {a.root or first for a in [*variant.apply, *variant.verify, *variant.rollback]
                 if a.runs_on(target.kind)}
        copies: dict[Path, Path] = {}
        for i, root in enumerate(dict.fromkeys(roots[n] for n in sorted(named))):
            copies[root] = folder / "roots" / str(i) / root.name  # its name kept: a package is imported by it
            shutil.copytree(root, copies[root], symlinks=True)
        project = job.project.relocated({n: copies[p] for n, p in roots.items() if p in copies}, folder / "state")
        self.store = Store(project.db_path)
        self.journal = Journal(self.store, project.state_dir, project.target.roots)
        self.run = open_run(project, self.store, self.journal, "screen")
        self.run.pairing = job.pairing
        for plugin_id, row in job.kept.items():  # what the copies hold: the target's kept state
            self.store.deploy(plugin_id, row["step_id"], loads(row["params"]), kept_at=row["kept_at"])
        self.deployment = Deployment(self.store, self.journal)
        self.prober = Prober(self.run, job.plugins)
        self.kept = KeptState.of(list(job.kept))
        self.kept.configuration, self.kept.judged = job.configuration, list(job.judged)

    def release(self) -> None:
        """Stop every server it started (their records end with them)."""
        self.kept.release()
        self.prober.release()

    def close(self) -> None:
        try:
            self.release()
        finally:
            self.store.close()


def screen(job: Job, worker: str, partner=None) -> Screened:
    """Stage the job's candidate on a copy of the kept state, as the run would on the target; `partner`: the other
    worker of a duet (workers.py), which samples the arm this one does not."""
    started = time.monotonic()
    with working(job), ExitStack() as stack:
        box = Copy(job, job.folder())
        stack.callback(box.close)
        box.run.partner = partner
        stager = Stager(box.run, box.prober, box.kept, box.deployment, job.noise)
        failed = None
        try:
            candidate = stager.attempt(job.plugin, job.variant)
            if candidate is not None:
                candidate.release()
        except EnvironmentFailed as e:
            failed = str(e)
        except Exception as e:  # noqa: BLE001 - the plugin's own, as Stager.choose takes it; else the worker's
            if not plugins_own(e):
                raise
            stager.unexpected(job.plugin, job.variant, e)
        box.release()
        step = box.store.steps(box.run.run_id)[-1]
        control = loads(step["control"]) or {}
        rows = box.store.recorded()
        read = {m["probe"]: loads(m["metrics"]) for m in rows["measurements"]
                if m["role"] == "configuration" and m["arm"] == "candidate" and m["ok"]} or None
        duet = partner.finish() if partner is not None else None
        busy = time.monotonic() - started + (partner.overlap() if partner is not None else 0.0)
        return Screened(job.key, worker, step, rows, read, busy, failed,
                        [control["probe"]] if failed and control.get("probe") else [], duet)


def control(job: Job, worker: str, probes: list[str]) -> Checked:
    """Run these probes (every correctness and throughput probe where none is named) on a copy of the kept state:
    whether they pass there, as the control of a candidate whose worker failed under it."""
    with working(job), ExitStack() as stack:
        box = Copy(job, job.folder("control"))
        stack.callback(box.close)
        specs = [s for s in [*box.prober.correctness, *box.prober.throughput] if not probes or s.name in probes]
        step_id = box.store.new_step(box.run.run_id, job.plugin_id, "checking", params=job.params)
        failed = None
        for spec in specs:
            out = box.prober.probe(spec, step_id, box.kept.arm, "control", 0, f"(control of {job.name})")
            if not out.ok:
                failed = spec.name, failure(out)
                break
        box.release()
        passed = ", ".join(s.name for s in specs), "passed"
        return Checked(worker, failed is None, *(failed or passed), box.store.recorded())


class Duo:
    """A duet's partner worker: its copy holds the kept state and the candidate applied by the same steps; it
    samples whichever arm the worker that judges asks for (pairing.Duet)."""

    def __init__(self, job: Job):
        self.job = job
        self.stack = ExitStack()
        self.stack.enter_context(working(job))
        self.box = Copy(job, job.folder("partner"))
        self.stack.callback(self.box.close)
        run, store = self.box.run, self.box.store
        self.step_id = store.new_step(run.run_id, job.plugin_id, "applying", params=job.params, image="post",
                                      objective=self.box.prober.objective)
        apply_all([s for s in job.variant.apply if s.runs_on(run.kind)], run.context(job.plugin, self.step_id))
        self.box.journal.seal(self.step_id)
        store.set_step(self.step_id, state="measuring")
        self.side: Side | None = None

    def pin(self, pinned: str | None) -> None:
        """Its arms, each on a server of its own where `pinned` (as the judging worker's are)."""
        base, cand = self.box.kept.arm, Arm([*self.job.kept, self.job.plugin_id])
        base.show = lambda: self.box.journal.show(self.step_id, "pre")
        cand.show = lambda: self.box.journal.show(self.step_id, "post")
        self.side = Side(self.box.prober, {"baseline": base, "candidate": cand}, "candidate", pinned)

    def sample(self, label: str, n: int, start_at: float) -> Sample:
        """One sample of an arm here. A failure of the candidate's is first re-checked on the kept state here (the
        control): where that fails too, or the kept state's own sample fails, this worker is at fault
        (EnvironmentFailed); else it is the candidate's (ArmFailed)."""
        try:
            return self.side.sample(self.step_id, label, n, self.job.name, start_at)
        except ArmFailed as e:
            if label == "baseline":
                raise EnvironmentFailed(f"the kept state fails on the partner worker: {e}") from None
            self.side.restart()
            base = self.side.arms["baseline"]
            base.put_on_disk()
            self.side.on_disk = "baseline"
            control = self.box.prober.probe(e.spec, self.step_id, base, "control", n, f"(control of {self.job.name})")
            if not control.ok:
                raise EnvironmentFailed(f"probe {e.spec.name} fails on the partner worker's kept state too "
                                        f"(control: {failure(control)})") from None
            raise

    def restart(self) -> None:
        self.side.restart()

    def finish(self) -> dict[str, list[dict]]:
        """Its servers stopped, what it recorded."""
        try:
            if self.side is not None:
                self.side.restart()
            return self.box.store.recorded()
        finally:
            self.stack.close()
