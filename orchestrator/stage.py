"""The staging loop: the only place that sequences preconditions, apply, verify, probes and the decision."""
from __future__ import annotations

import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from orchestrator import decide
from orchestrator.config import Policy, ProbeSpec, Project
from orchestrator.journal import Journal
from orchestrator.plugin import Plugin, Variant
from orchestrator.probes.runner import ProbeResult, judge_output, run_process
from orchestrator.recovery import recover
from orchestrator.status import FINAL, WITHOUT, environment
from orchestrator.steps import StepContext, StepFailed, apply_all, check, undo_step
from orchestrator.store import Store, dumps, loads


class Interrupted(Exception):
    """Raised from a signal handler (SIGTERM) so the loop restores the target before exiting."""


class BaselineFailed(Exception):
    pass


class ArmFailed(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class Reporter:
    """Progress callbacks for the CLI; the default reports nothing."""

    def phase(self, plugin: str, phase: str) -> None: ...
    def tick(self, elapsed: float, tail: str) -> None: ...
    def outcome(self, plugin: str, outcome: str, reason: str | None, gain: float | None) -> None: ...


@dataclass
class Sample:
    value: float
    metrics: dict[str, Any]


@dataclass
class Verdict:
    step_id: int
    decision: decide.Decision | None
    base: list[Sample] = field(default_factory=list)
    cand: list[Sample] = field(default_factory=list)


def medians(samples: Sequence[dict[str, Any]]) -> dict[str, float]:
    keys = set.intersection(*(set(s) for s in samples)) if samples else set()
    return {k: statistics.median(s[k] for s in samples) for k in sorted(keys)
            if all(isinstance(s[k], (int, float)) and not isinstance(s[k], bool) for s in samples)}


def failure(out: ProbeResult) -> str:
    """The probe's verdict and the last lines it wrote, for the step's detail."""
    proc = out.process
    lines = [ln.strip() for ln in ((proc.stderr_tail or proc.stdout_tail) if proc else "").splitlines() if ln.strip()]
    return out.message + (f" (output: {' | '.join(lines[-2:])[-300:]})" if lines else "")


MEASURED = "measured"  # outcome of a re-measurement step: it leaves the deployment as it was


def without(plugin_id: str) -> str:
    return f"{WITHOUT}{plugin_id})"


def fingerprint() -> dict | None:
    try:
        return environment()
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 - a broken fingerprint must not stop a measurement
        return {"error": repr(e)}


class Stager:
    def __init__(self, project: Project, plugins: list[Plugin], store: Store, journal: Journal,
                 reporter: Reporter | None = None):
        self.project = project
        self.target = project.target
        self.kind = self.target.kind
        self.plugins = plugins
        self.store = store
        self.journal = journal
        self.reporter = reporter or Reporter()
        self.correctness = [p for p in project.probes if p.role == "correctness"]
        self.throughput = [p for p in project.probes if p.role == "throughput"]
        self.objective = self.throughput[0].objective if self.throughput else None
        self.tmp = project.state_dir / "tmp"
        self.run_id: int | None = None
        self.kept: set[str] = set()
        self.kept_samples: list[Sample] | None = None
        self.run_kept: list[int] = []  # steps kept by this run, in order

    # environment and processes
    def env(self, plugin: str) -> dict[str, str]:
        roots = self.target.roots
        env = {**os.environ, **self.target.env(),
               "ORCHESTRATOR_TARGET_ROOT": str(next(iter(roots.values()))),
               "ORCHESTRATOR_RUN_ID": str(self.run_id), "ORCHESTRATOR_PLUGIN": plugin}
        for name, path in roots.items():
            env[f"ORCHESTRATOR_ROOT_{re.sub(r'[^A-Za-z0-9]', '_', name).upper()}"] = str(path)
        return env

    def _recorder(self, step_id: int | None):
        def on_start(what: str, pid: int, create_time: float):
            proc_id = self.store.add_process(self.run_id, step_id, what, pid, pid, create_time)
            return lambda: self.store.end_process(proc_id)
        return on_start

    def context(self, plugin: Plugin, step_id: int | None) -> StepContext:
        return StepContext(self.target.roots, self.kind, plugin.folder, self.env(plugin.id), self.journal, step_id,
                           on_start=self._recorder(step_id), on_tick=self.reporter.tick, tmp_dir=self.tmp)

    def probe(self, spec: ProbeSpec, step_id: int | None, arm: str, repeat: int, plugin: str) -> ProbeResult:
        self.reporter.phase(plugin, f"probe {spec.name} ({arm} #{repeat + 1})")
        on_start = self._recorder(step_id)
        result = run_process(spec.command, self.project.base_dir, self.env(plugin), spec.timeout,
                             on_start=lambda pid, ct: on_start(f"probe {spec.name}", pid, ct),
                             on_tick=self.reporter.tick, tmp_dir=self.tmp)
        out = judge_output(spec.role, spec.objective, result, spec.timeout)
        self.store.add_measurement(run_id=self.run_id, step_id=step_id, probe=spec.name, role=spec.role, arm=arm,
                                   repeat=repeat, ok=int(out.ok), reason=out.reason, value=out.value,
                                   metrics=out.metrics, duration=result.duration, returncode=result.returncode,
                                   stdout_tail=result.stdout_tail, stderr_tail=result.stderr_tail,
                                   fingerprint=fingerprint() if spec.role == "throughput" else None)
        return out

    def sample(self, step_id: int | None, arm: str, repeat: int, plugin: str) -> Sample:
        """One measurement of the state on disk: every throughput probe once, metrics merged."""
        metrics: dict[str, Any] = {}
        value = None
        for spec in self.throughput:
            out = self.probe(spec, step_id, arm, repeat, plugin)
            if not out.ok:
                raise ArmFailed(out.reason or "probe_failed", f"{arm} arm, probe {spec.name}: {failure(out)}")
            metrics.update({k: v for k, v in out.metrics.items() if k not in metrics})
            if value is None:
                value = out.value
        return Sample(value, metrics)

    # the run
    def run(self, only: set[str] | None = None, skip: set[str] | None = None, attribute: bool = False,
            reverify: bool = False) -> int:
        """Stage the plugins, then re-validate the stack this run kept (and, with `attribute`, each plugin's share);
        `reverify` instead re-judges the kept plugins whose decisions were measured in another environment."""
        self.run_id = self.store.start_run("run", str(self.project.source or "<embedded default>"), self.kind)
        self.tmp.mkdir(parents=True, exist_ok=True)
        deployed = self.store.deployed()
        self.kept = set(deployed)
        try:
            if reverify:
                self.reverify()
            else:
                self.baseline()
                for plugin in self.plugins:
                    if (only and plugin.id not in only) or (skip and plugin.id in skip):
                        continue
                    self.stage(plugin)
                if self.throughput and self.run_kept:
                    self.revalidate()
                    if attribute:
                        self.attribute()
        except (KeyboardInterrupt, Interrupted):
            recover(self.store, self.journal, "interrupted", "stopped by a signal")
            raise
        except BaselineFailed as e:
            self.store.finish_run(self.run_id, "failed", str(e))
            return self.run_id
        except Exception as e:
            recover(self.store, self.journal, "failed", f"internal error: {e!r}")
            raise
        self.store.finish_run(self.run_id, "finished")
        return self.run_id

    def baseline(self) -> None:
        for spec in self.correctness:
            out = self.probe(spec, None, "baseline", 0, "baseline")
            if not out.ok:
                self.store.event(self.run_id, "warning", f"baseline fails correctness probe {spec.name}: {out.message}")
        if not self.throughput:
            return
        try:
            samples = [self.sample(None, "baseline", i, "baseline") for i in range(self.project.policy.repeats)]
        except ArmFailed as e:
            raise BaselineFailed(f"cannot measure the baseline: {e}") from None
        self.kept_samples = samples
        self.store.update_run(self.run_id, baseline=dumps(medians([s.metrics for s in samples])))

    def skip(self, plugin: Plugin, reason: str, detail: str) -> None:
        step_id = self.store.new_step(self.run_id, plugin.id, "done")
        self.store.finish_step(step_id, "skipped", reason, detail)
        self.reporter.outcome(plugin.id, "skipped", reason, None)

    def stage(self, plugin: Plugin) -> None:
        m = plugin.manifest
        self.reporter.phase(plugin.id, "preconditions")
        if self.kind not in m.targets:
            return self.skip(plugin, "not_applicable", f"for targets {', '.join(m.targets)}; this one is {self.kind}")
        missing = [r for r in m.requires if r not in self.kept]
        if missing:
            return self.skip(plugin, "dependency_not_kept", f"requires {', '.join(missing)}, not kept")
        earlier = self.store.deployed().get(plugin.id)
        if earlier:
            changed = self.journal.drifted(earlier["step_id"])
            if not changed:
                return self.already_applied(plugin, earlier)
            # staged again; the earlier record stays until a new keep replaces it, so rollback can still undo it
            self.kept.discard(plugin.id)
            self.store.event(self.run_id, "stale", f"{plugin.id}: kept earlier but {', '.join(changed)} changed since")
        ctx = self.context(plugin, None)
        for chk in plugin.variants[0].applies_if:
            if chk.runs_on(self.kind):
                ok, why = check(chk, ctx)
                if not ok:
                    return self.skip(plugin, "not_applicable", why)
        defer = len(plugin.variants) > 1
        verdicts = [v for v in (self.attempt(plugin, variant, defer) for variant in plugin.variants) if v]
        if defer and verdicts:
            best = max(verdicts, key=lambda v: v.decision.gain if v.decision and v.decision.gain is not None else 0)
            for v in verdicts:
                if v is not best:
                    self.finish(plugin, v.step_id, "rolled_back", "outperformed", v,
                                f"another candidate gained more (step {best.step_id})")
            self.journal.show(best.step_id, "post")
            self.keep(plugin, best)

    def already_applied(self, plugin: Plugin, earlier: dict) -> None:
        original = self.store.step(earlier["step_id"])
        step_id = self.store.new_step(self.run_id, plugin.id, "done", params=None)
        self.store.finish_step(step_id, "kept", "already_applied",
                               f"kept in run {original['run_id']}; its files are unchanged",
                               **{k: original[k] for k in ("params", "gain", "objective", "before_value",
                                                          "after_value", "metrics", "baseline_metrics")})
        self.kept.add(plugin.id)
        self.reporter.outcome(plugin.id, "kept", "already_applied", original["gain"])

    def attempt(self, plugin: Plugin, variant: Variant, defer: bool) -> Verdict | None:
        """Stage one variant; returns its verdict when it should be kept but `defer` leaves the choice to the caller."""
        name = plugin.id + (f" [{variant.label}]" if variant.params else "")
        step_id = self.store.new_step(self.run_id, plugin.id, "applying", params=variant.params, image="post",
                                      objective=self.objective)
        policy = self.project.policy.merged(plugin.manifest.accept)
        ctx = self.context(plugin, step_id)
        self.reporter.phase(name, "apply")
        try:
            apply_all([s for s in variant.apply if s.runs_on(self.kind)], ctx)
        except StepFailed as e:
            return self.roll_back(plugin, variant, step_id, "apply_failed", str(e), ctx)
        self.journal.seal(step_id)
        self.store.set_step(step_id, state="verifying")
        self.reporter.phase(name, "verify")
        for chk in variant.verify:
            if chk.runs_on(self.kind):
                ok, why = check(chk, ctx)
                if not ok:
                    return self.roll_back(plugin, variant, step_id, "verify_failed", why, ctx)
        self.store.set_step(step_id, state="checking")
        for spec in self.correctness:
            out = self.probe(spec, step_id, "candidate", 0, name)
            if not out.ok:
                return self.roll_back(plugin, variant, step_id, out.reason, f"probe {spec.name}: {failure(out)}", ctx)
        if not self.throughput:
            return self.accept(plugin, Verdict(step_id, None), defer, None)
        self.store.set_step(step_id, state="measuring")
        try:
            verdict = self.measure(step_id, policy, name)
        except ArmFailed as e:
            return self.roll_back(plugin, variant, step_id, e.reason, str(e), ctx)
        d = verdict.decision
        vetoes = decide.check_guardrails(policy.guardrails, [s.metrics for s in verdict.base],
                                         [s.metrics for s in verdict.cand])
        self.store.add_decision(self.run_id, step_id, self.objective, d.to_dict(), vetoes, policy.model_dump())
        self.store.set_step(step_id, state="deciding", **self._numbers(verdict))
        keep = d.verdict == "keep" or (d.verdict == "inconclusive" and policy.on_inconclusive == "keep")
        if keep and vetoes:
            return self.roll_back(plugin, variant, step_id, "guardrail", "; ".join(vetoes), ctx)
        if not keep:
            reason = {"regressed": "regressed", "no_gain": "no_gain"}.get(d.verdict, "inconclusive")
            return self.roll_back(plugin, variant, step_id, reason, self._describe(d), ctx)
        return self.accept(plugin, verdict, defer, None if d.verdict == "keep" else "inconclusive")

    def accept(self, plugin: Plugin, verdict: Verdict, defer: bool, reason: str | None) -> Verdict | None:
        """Keep now, or (params) leave the last kept state on disk and let the best candidate win later."""
        if not defer:
            self.journal.show(verdict.step_id, "post")
            self.keep(plugin, verdict, reason)
            return None
        self.journal.show(verdict.step_id, "pre")
        self.store.set_step(verdict.step_id, state="candidate")
        return verdict

    def measure(self, step_id: int, policy: Policy, name: str) -> Verdict:
        """Interleaved A/B pairs until the judge decides, or one baseline reused against added candidate samples."""
        judge = decide.Judge(policy)
        if policy.interleave:
            return self.interleaved(step_id, judge, policy, name, lambda: self.journal.show(step_id, "pre"),
                                    lambda: self.journal.show(step_id, "post"))
        if self.kept_samples is None:
            self.journal.show(step_id, "pre")
            self.kept_samples = [self.sample(step_id, "baseline", i, name) for i in range(policy.repeats)]
            self.journal.show(step_id, "post")
        base = self.kept_samples
        b = [s.value for s in base]
        cand: list[Sample] = []
        if policy.rule == "first":
            cand = [self.sample(step_id, "candidate", i, name) for i in range(policy.repeats)]
            return Verdict(step_id, decide.first_rule(b, [s.value for s in cand], policy.min_gain), base, cand)
        while True:
            cand.append(self.sample(step_id, "candidate", len(cand), name))
            d = judge.decide(b, [s.value for s in cand], final=len(cand) >= policy.max_pairs)
            if d is not None:
                return Verdict(step_id, d, base, cand)

    def interleaved(self, step_id: int | None, judge: decide.Judge, policy: Policy, name: str,
                    show_base: Callable[[], None], show_cand: Callable[[], None]) -> Verdict:
        """Pairs until the judge decides; odd pairs measure the candidate first (A B, B A, ...), so a lag within a
        pair (warm caches, a drifting clock) favours each arm equally often, and consecutive pairs share a switch."""
        base: list[Sample] = []
        cand: list[Sample] = []
        while True:
            n = len(base)
            arms = [("baseline", show_base, base), ("candidate", show_cand, cand)]
            for arm, show, samples in (arms if n % 2 == 0 else arms[::-1]):
                show()
                samples.append(self.sample(step_id, arm, n, name))
            d = judge.decide([s.value for s in base], [s.value for s in cand], final=n + 1 >= policy.max_pairs)
            if d is not None:
                return Verdict(step_id, d, base, cand)

    def _numbers(self, v: Verdict) -> dict[str, Any]:
        d = v.decision
        return dict(gain=d.gain if d else None,
                    before_value=d.baseline_median if d else None, after_value=d.candidate_median if d else None,
                    metrics=dumps(medians([s.metrics for s in v.cand])) if v.cand else None,
                    baseline_metrics=dumps(medians([s.metrics for s in v.base])) if v.base else None)

    @staticmethod
    def _describe(d: decide.Decision) -> str:
        gain = "n/a" if d.gain is None else f"{d.gain:+.2%}"
        notes = f"; {'; '.join(d.notes)}" if d.notes else ""
        return f"{d.verdict}: gain {gain} over {d.n_baseline}/{d.n_candidate} samples ({d.rule} rule){notes}"

    def keep(self, plugin: Plugin, verdict: Verdict, reason: str | None = None) -> None:
        step = self.store.step(verdict.step_id)
        with self.store.transaction():
            self.store.deploy(plugin.id, verdict.step_id, loads(step["params"]))
            self.store.finish_step(verdict.step_id, "kept", reason,
                                   self._describe(verdict.decision) if verdict.decision else "no throughput probe configured")
        self.kept.add(plugin.id)
        self.run_kept.append(verdict.step_id)
        if verdict.cand:
            self.kept_samples = verdict.cand
        self.reporter.outcome(plugin.id, "kept", reason, verdict.decision.gain if verdict.decision else None)

    def finish(self, plugin: Plugin, step_id: int, outcome: str, reason: str, verdict: Verdict, detail: str) -> None:
        self.store.finish_step(step_id, outcome, reason, detail)
        self.reporter.outcome(plugin.id, outcome, reason, verdict.decision.gain if verdict.decision else None)

    def roll_back(self, plugin: Plugin, variant: Variant, step_id: int, reason: str, detail: str,
                  ctx: StepContext) -> None:
        """Restore every touched file, then run the plugin's own rollback steps in reverse."""
        self.reporter.phase(plugin.id, f"rollback ({reason})")
        self.store.set_step(step_id, state="rolling_back")
        self.journal.restore(step_id, exact=True)
        self.undo_steps(plugin, variant, step_id, ctx)
        self.store.finish_step(step_id, "rolled_back", reason, detail)
        self.reporter.outcome(plugin.id, "rolled_back", reason, None)
        return None

    def undo_steps(self, plugin: Plugin, variant: Variant, step_id: int, ctx: StepContext) -> None:
        """The plugin's own rollback steps, in reverse; a failure is recorded and the rest still run."""
        for step in reversed(variant.rollback):
            if step.runs_on(self.kind):
                try:
                    undo_step(step, ctx)
                except StepFailed as e:
                    self.store.event(self.run_id, "rollback_step_failed", f"{plugin.id}: {e}", step_id)

    # re-measuring the deployment: each comparison is a step whose pre-image is the deployment and whose
    # post-image is the state compared with it, so recovery after a crash anywhere puts the deployment back
    def switch_step(self, name: str, images: list[tuple[dict, dict]], params: dict | None = None) -> int:
        """`images`: (row holding the deployed image, row whose pre-image is compared) per file."""
        step_id = self.store.new_step(self.run_id, name, "measuring", params=params, objective=self.objective)
        self.store.add_files([dict(step_id=step_id, root=now["root"], root_path=now["root_path"], path=now["path"],
                                   kind="file", before=now["after"], before_mode=now["after_mode"],
                                   after=then["before"], after_mode=then["before_mode"], sealed=1)
                              for now, then in images if now["after"] != then["before"]])
        return step_id

    def compare(self, step_id: int, policy: Policy, name: str) -> Verdict:
        """The compared state is the baseline arm and the deployment the candidate, so the gain is the
        deployment's; the target ends as deployed whatever happens."""
        policy = policy.model_copy(update={"interleave": True})  # pairs, whatever the plugins' mode
        try:
            return self.interleaved(step_id, decide.Judge(policy), policy, name,
                                    lambda: self.journal.show(step_id, "post"), lambda: self.journal.show(step_id, "pre"))
        finally:
            self.journal.show(step_id, "pre")

    def record(self, step_id: int, verdict: Verdict, policy: Policy, outcome: str, reason: str | None, detail: str,
               vetoes: list[str] = ()) -> None:
        self.store.add_decision(self.run_id, step_id, self.objective, verdict.decision.to_dict(), list(vetoes),
                                policy.model_dump())
        self.store.finish_step(step_id, outcome, reason, detail, **self._numbers(verdict))
        self.reporter.outcome(self.store.step(step_id)["plugin"], outcome, reason, verdict.decision.gain)

    def files(self, step_id: int) -> list[dict]:
        return [f for f in self.store.file_rows(step_id) if f["kind"] == "file"]

    def revalidate(self) -> None:
        """The whole stack this run kept against the target as it was before the run's first kept change."""
        first: dict[tuple[str, str], dict] = {}
        last: dict[tuple[str, str], dict] = {}
        for sid in self.run_kept:
            for f in self.files(sid):
                first.setdefault((f["root_path"], f["path"]), f)
                last[(f["root_path"], f["path"])] = f
        policy = self.project.policy
        step_id, verdict = self.measure_switch(FINAL, [(last[k], first[k]) for k in last], "re-validating the kept stack")
        if verdict is None:
            return
        d = verdict.decision
        better = d.verdict == "keep"
        detail = f"kept stack against the run's baseline: {self._describe(d)}"
        self.record(step_id, verdict, policy, MEASURED, None if better else "stack_not_better", detail)
        if not better:
            self.store.event(self.run_id, "warning", f"the kept stack as a whole is not better than the baseline "
                                                     f"({detail}); nothing was rolled back", step_id)

    def measure_switch(self, name: str, images: list[tuple[dict, dict]], phase: str) -> tuple[int, Verdict | None]:
        """A comparison step of the deployment against another state; None when an arm failed (recorded)."""
        step_id = self.switch_step(name, images)
        self.reporter.phase(name, phase)
        try:
            return step_id, self.compare(step_id, self.project.policy, name)
        except ArmFailed as e:
            self.store.finish_step(step_id, MEASURED, e.reason, str(e))
            return step_id, None

    def clashes(self, step_id: int) -> list[str]:
        """Later kept plugins that changed a file of this step: its pre-images would undo their changes too."""
        order = [row["step_id"] for row in self.store.deployed().values()]
        mine = {(f["root_path"], f["path"]) for f in self.files(step_id)}
        found = []
        for later in order[order.index(step_id) + 1:] if step_id in order else []:
            shared = sorted(f["path"] for f in self.files(later) if (f["root_path"], f["path"]) in mine)
            if shared:
                found.append(f"{self.store.step(later)['plugin']} ({', '.join(shared)})")
        return found

    def attribute(self) -> None:
        """Leave-one-out: each plugin this run kept, switched to its pre-images, against the whole stack."""
        policy = self.project.policy
        for sid in list(self.run_kept):
            plugin_id = self.store.step(sid)["plugin"]
            name = without(plugin_id)
            clashes = self.clashes(sid)
            if clashes:
                step_id = self.store.new_step(self.run_id, name, "done")
                self.store.finish_step(step_id, MEASURED, "not_separable",
                                       f"later kept plugins changed the same files: {'; '.join(clashes)}")
                self.reporter.outcome(name, MEASURED, "not_separable", None)
                continue
            step_id, verdict = self.measure_switch(name, [(f, f) for f in self.files(sid)], "leave-one-out")
            if verdict is None:
                continue
            self.record(step_id, verdict, policy, MEASURED, None,
                        f"contribution of {plugin_id} to the stack: {self._describe(verdict.decision)}")

    def reverify(self) -> None:
        """Re-judge each kept plugin whose decision was measured under another fingerprint: its pre-images
        against its post-images, interleaved; keep it (re-recorded under this environment) or roll it back."""
        from orchestrator.fingerprint import describe, is_stale
        current = fingerprint()
        by_id = {p.id: p for p in self.plugins}
        for plugin_id, row in self.store.deployed().items():
            sid = row["step_id"]
            recorded = self.store.fingerprint_of(sid)
            if recorded is None or current is None or not is_stale(recorded, current):
                continue
            params = loads(row["params"])
            why = describe(recorded, current)
            plugin = by_id.get(plugin_id)
            changed, clashes = self.journal.drifted(sid), self.clashes(sid)
            problem = None
            if plugin is None:
                problem = ("not_applicable", "its plugin folder is gone")
            elif changed:
                problem = ("files_changed", f"files changed since it was kept: {', '.join(changed)}")
            elif clashes:
                problem = ("not_separable", f"later kept plugins changed the same files: {'; '.join(clashes)}")
            if problem:
                step_id = self.store.new_step(self.run_id, plugin_id, "done", params=params)
                self.store.finish_step(step_id, "skipped", problem[0], f"stale ({why}) but {problem[1]}")
                self.reporter.outcome(plugin_id, "skipped", problem[0], None)
                continue
            self.rejudge(plugin, row, params, why)

    def rejudge(self, plugin: Plugin, row: dict, params: dict | None, why: str) -> None:
        step_id = self.switch_step(plugin.id, [(f, f) for f in self.files(row["step_id"])], params)
        policy = self.project.policy.merged(plugin.manifest.accept)
        self.reporter.phase(plugin.id, "re-verify")
        try:
            verdict = self.compare(step_id, policy, plugin.id)
        except ArmFailed as e:
            self.store.finish_step(step_id, MEASURED, e.reason, f"stale ({why}); re-verification failed, left kept: {e}")
            return
        d = verdict.decision
        vetoes = decide.check_guardrails(policy.guardrails, [s.metrics for s in verdict.base],
                                         [s.metrics for s in verdict.cand])
        self.store.add_decision(self.run_id, step_id, self.objective, d.to_dict(), vetoes, policy.model_dump())
        numbers = self._numbers(verdict)
        detail = f"re-judged after {why}: {self._describe(d)}"
        if decide.Judge(policy).keeps(d) and not vetoes:
            dirs = [dict(step_id=step_id, root=d["root"], root_path=d["root_path"], path=d["path"], kind="dir")
                    for d in self.store.file_rows(row["step_id"]) if d["kind"] == "dir"]
            with self.store.transaction():  # the step becomes the plugin's record: its rows turn the usual way round
                self.store.swap_images(step_id)
                self.store.add_files(dirs)
                self.store.deploy(plugin.id, step_id, params, kept_at=row["kept_at"])
                self.store.finish_step(step_id, "kept", "reverified", detail, **numbers)
            self.reporter.outcome(plugin.id, "kept", "reverified", d.gain)
            return
        reason = "guardrail" if decide.Judge(policy).keeps(d) else {"regressed": "regressed", "no_gain": "no_gain"}.get(
            d.verdict, "inconclusive")
        self.journal.show(step_id, "post")
        variant = next((v for v in plugin.variants if v.params == (params or {})), plugin.variants[0])
        self.undo_steps(plugin, variant, step_id, self.context(plugin, step_id))
        dependents = [p.id for p in self.plugins if plugin.id in p.manifest.requires and p.id in self.store.deployed()]
        with self.store.transaction():
            self.store.undeploy(plugin.id)
            self.store.finish_step(step_id, "rolled_back", reason, detail + ("; vetoed: " + "; ".join(vetoes)
                                                                           if vetoes else ""), **numbers)
        if dependents:
            self.store.event(self.run_id, "warning", f"{plugin.id} rolled back; still kept although they require it: "
                                                     f"{', '.join(dependents)}", step_id)
        self.reporter.outcome(plugin.id, "rolled_back", reason, d.gain)
