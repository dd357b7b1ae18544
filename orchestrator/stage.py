"""One plugin staged to an outcome: preconditions, then for each params combination apply, verify, correctness
probes, measurement and the decision; the best candidate is kept, every other attempt rolled back byte for byte."""
from __future__ import annotations

import traceback
from dataclasses import dataclass

from orchestrator import decide
from orchestrator.config import ProbeSpec
from orchestrator.context import RunContext
from orchestrator.deployment import Deployment
from orchestrator.errors import UserError
from orchestrator.failures import is_environment
from orchestrator.images import TouchError
from orchestrator.measure import (ArmFailed, EnvironmentFailed, Measurer, Verdict, describe, failure, guardrail_vetoes,
                                  numbers)
from orchestrator.plugin import Plugin, Variant
from orchestrator.probes.runner import ProbeResult
from orchestrator.steps import StepFailed, apply_all, check
from orchestrator.store import dumps


def plugins_own(error: Exception) -> bool:
    """Whether an unforeseen error is the staged plugin's alone: not the machine's (a full disk, the database)
    nor the state folder's (UserError: a damaged blob), which stop the run instead."""
    return not (isinstance(error, (EnvironmentFailed, UserError)) or is_environment(error))


@dataclass
class Candidate:
    """An attempt that may be kept. Its step is in state `candidate` and the last kept state is on disk."""
    verdict: Verdict
    reason: str | None  # the reason it would be kept with: None, or inconclusive (on_inconclusive: keep)

    @property
    def step_id(self) -> int:
        return self.verdict.step_id

    @property
    def gain(self) -> float:
        d = self.verdict.decision
        return d.gain if d and d.gain is not None else 0


class Stager:
    def __init__(self, run: RunContext, measurer: Measurer, deployment: Deployment):
        self.run = run
        self.store = run.store
        self.journal = run.journal
        self.reporter = run.reporter
        self.measurer = measurer
        self.deployment = deployment

    def stage(self, plugin: Plugin) -> None:
        """Skip it, find it already applied, or attempt every params combination and keep the best candidate."""
        try:
            if not self.ready(plugin):
                return
        except Exception as e:
            if not plugins_own(e):
                raise
            return self.unexpected(plugin, None, e)
        candidates: list[Candidate] = []
        try:
            for variant in plugin.variants:
                try:
                    candidate = self.attempt(plugin, variant)
                except Exception as e:
                    if not plugins_own(e):
                        raise
                    candidate = self.unexpected(plugin, variant, e)
                if candidate is not None:
                    candidates.append(candidate)
        except EnvironmentFailed:
            for c in candidates:  # the last kept state is on disk: close them undecided
                self.store.finish_step(c.step_id, "rolled_back", "environment_failed",
                                       "not chosen: the run stopped on an environment failure")
            raise
        if not candidates:
            return
        best = max(candidates, key=lambda c: c.gain)
        for c in candidates:
            if c is not best:
                self.store.finish_step(c.step_id, "rolled_back", "outperformed",
                                       f"another candidate gained more (step {best.step_id})")
                d = c.verdict.decision
                self.reporter.outcome(plugin.id, "rolled_back", "outperformed", d.gain if d else None)
        self.keep(plugin, best)

    def unexpected(self, plugin: Plugin, variant: Variant | None, error: Exception) -> None:
        """An error nothing foresaw (a bug, an odd file) fails this plugin only: its open step is rolled back with
        the reason of the phase it was in and a one-line description; the traceback goes to the events."""
        step = next((s for s in self.store.open_steps() if s["run_id"] == self.run.run_id
                     and s["plugin"] == plugin.id and s["state"] != "candidate"), None)
        what = " ".join(f"{type(error).__name__}: {error}".split())[:500]
        if step is None or variant is None:
            step_id = step["id"] if step else self.store.new_step(self.run.run_id, plugin.id, "applying")
            self.store.event(self.run.run_id, "error", f"{plugin.id}: {traceback.format_exc()}", step_id)
            if step is not None:
                self.journal.restore(step_id, exact=True)
            self.store.finish_step(step_id, "rolled_back", "apply_failed", f"unexpected error: {what}")
            self.reporter.outcome(plugin.id, "rolled_back", "apply_failed", None)
            return None
        self.store.event(self.run.run_id, "error", f"{plugin.id}: {traceback.format_exc()}", step["id"])
        reason = {"applying": "apply_failed", "verifying": "verify_failed"}.get(step["state"], "probe_failed")
        return self.roll_back(plugin, variant, step["id"], reason, f"unexpected error while {step['state']}: {what}")

    def ready(self, plugin: Plugin) -> bool:
        """Whether to attempt the plugin; when not, its skip or `already_applied` step is recorded."""
        m = plugin.manifest
        kind = self.run.kind
        self.reporter.phase(plugin.id, "preconditions")
        if kind not in m.targets:
            return self.skip(plugin, "not_applicable", f"for targets {', '.join(m.targets)}; this one is {kind}")
        missing = [r for r in m.requires if not self.deployment.holds(r)]
        if missing:
            return self.skip(plugin, "dependency_not_kept", f"requires {', '.join(missing)}, not kept")
        earlier = self.deployment.rows().get(plugin.id)
        if earlier:
            changed = self.deployment.drifted(earlier["step_id"])
            if not changed:
                return self.already_applied(plugin, earlier)
            # staged again; the earlier record stays until a new keep replaces it, so rollback can still undo it
            self.store.event(self.run.run_id, "stale", f"{plugin.id}: kept earlier but {', '.join(changed)} changed since")
        ctx = self.run.context(plugin, None)
        for chk in plugin.variants[0].applies_if:
            if chk.runs_on(kind):
                ok, why = check(chk, ctx)
                if not ok:
                    return self.skip(plugin, "not_applicable", why)
        return True

    def decided_earlier(self, plugin: Plugin, earlier: list[dict]) -> None:
        """A run that continues a stopped one does not stage again what that run rolled back for a reason of its own."""
        run_id = earlier[0]["run_id"]
        reasons = ", ".join(dict.fromkeys(s["reason"] for s in earlier))
        self.skip(plugin, "decided_earlier", f"rolled back in run {run_id} ({reasons}), which this run continues; "
                                             "name it with --only to stage it again")

    def skip(self, plugin: Plugin, reason: str, detail: str) -> bool:
        step_id = self.store.new_step(self.run.run_id, plugin.id, "done")
        self.store.finish_step(step_id, "skipped", reason, detail)
        self.reporter.outcome(plugin.id, "skipped", reason, None)
        return False

    def already_applied(self, plugin: Plugin, earlier: dict) -> bool:
        original = self.store.step(earlier["step_id"])
        step_id = self.store.new_step(self.run.run_id, plugin.id, "done", params=None)
        self.store.finish_step(step_id, "kept", "already_applied",
                               f"kept in run {original['run_id']}; its files are unchanged",
                               **{k: original[k] for k in ("params", "gain", "objective", "before_value",
                                                          "after_value", "metrics", "baseline_metrics")})
        self.reporter.outcome(plugin.id, "kept", "already_applied", original["gain"])
        return False

    def attempt(self, plugin: Plugin, variant: Variant) -> Candidate | None:
        """Stage one params combination on the last kept state. Returns the candidate, or None when it was rolled
        back (its outcome recorded); either way the last kept state is on disk afterwards, and no live server of
        any state is left up."""
        try:
            return self.judge(plugin, variant)
        finally:
            self.measurer.release()

    def judge(self, plugin: Plugin, variant: Variant) -> Candidate | None:
        name = plugin.id + (f" [{variant.label}]" if variant.params else "")
        kind = self.run.kind
        step_id = self.store.new_step(self.run.run_id, plugin.id, "applying", params=variant.params, image="post",
                                      objective=self.measurer.objective)
        policy = self.run.project.policy.merged(plugin.manifest.accept)
        ctx = self.run.context(plugin, step_id)
        self.reporter.phase(name, "apply")
        try:
            apply_all([s for s in variant.apply if s.runs_on(kind)], ctx)
            self.journal.seal(step_id)
        except (StepFailed, TouchError) as e:
            return self.roll_back(plugin, variant, step_id, "apply_failed", str(e))
        self.store.set_step(step_id, state="verifying")
        self.reporter.phase(name, "verify")
        for chk in variant.verify:
            if chk.runs_on(kind):
                ok, why = check(chk, ctx)
                if not ok:
                    return self.roll_back(plugin, variant, step_id, "verify_failed", why)
        self.store.set_step(step_id, state="checking")
        kept = list(self.deployment.rows())
        self.measurer.hold(kept, [*kept, plugin.id])
        ignored, failed = self.measurer.unchanged(step_id, name)
        if failed:
            spec, out = failed
            return self.probe_failed(plugin, variant, step_id, name, spec, out, f"probe {spec.name}: {failure(out)}")
        if ignored is not None:
            return self.no_effect(plugin, variant, step_id, policy, ignored)
        if earlier := self.measurer.judged_like(step_id):
            other, other_step, reason = earlier
            return self.roll_back(plugin, variant, step_id, reason,
                                  f"runs what {other} ran (step {other_step}; the configuration probes read the same), "
                                  f"which was rolled back as {reason} against this same kept state: not measured again")
        failed = self.measurer.failed_correctness(step_id, "candidate", name)
        if failed:
            spec, out = failed
            return self.probe_failed(plugin, variant, step_id, name, spec, out, f"probe {spec.name}: {failure(out)}")
        if not self.measurer.throughput:
            return self.candidate(Verdict(step_id, None), None)
        self.store.set_step(step_id, state="measuring")
        try:
            verdict = self.measurer.measure(step_id, policy, name, lambda image: self.journal.show(step_id, image))
        except ArmFailed as e:
            return self.probe_failed(plugin, variant, step_id, name, e.spec, e.result, str(e))
        vetoes = guardrail_vetoes(policy, verdict)
        self.measurer.record(verdict, policy, vetoes)
        self.store.set_step(step_id, state="deciding", **numbers(verdict))
        outcome, reason = decide.outcome(verdict.decision, vetoes, policy)
        if outcome == "rolled_back":
            detail = "; ".join(vetoes) if reason == "guardrail" else describe(verdict.decision)
            self.measurer.remember(step_id, name, reason)
            return self.roll_back(plugin, variant, step_id, reason, detail)
        return self.candidate(verdict, reason)

    def no_effect(self, plugin: Plugin, variant: Variant, step_id: int, policy, ignored: dict[str, str]) -> None:
        """The candidate changes nothing the target runs here (its configuration probes read what the last kept
        state's read): no measurement could tell them apart but by noise, so it is rolled back as no_gain unmeasured,
        with what the target said it ignores."""
        why = "; ".join(f"{k}: {v}" for k, v in ignored.items())
        note = ("no effect here: the configuration probes read the same effective configuration as on the last "
                "kept state" + (f" (ignored: {why})" if why else ""))[:1500]
        d = decide.Decision("no_gain", None, rule="configuration", notes=[note], min_gain=policy.min_gain)
        self.measurer.record(Verdict(step_id, d), policy)
        self.store.set_step(step_id, state="deciding")
        return self.roll_back(plugin, variant, step_id, "no_gain", describe(d))

    def probe_failed(self, plugin: Plugin, variant: Variant, step_id: int, name: str, spec: ProbeSpec,
                     out: ProbeResult, detail: str) -> None:
        """A probe failed while the candidate was on disk: re-run it on the last kept state, the control (as
        Kayenta judges a canary against a control, not against history). When the control passes, the failure is
        the candidate's; when it fails too, the environment is at fault: roll back as environment_failed and
        stop the run (EnvironmentFailed)."""
        self.journal.show(step_id, "pre")
        control = self.measurer.control(spec, step_id, f"(control of {name})")
        self.store.set_step(step_id, control=dumps({"probe": spec.name, "passed": control.ok, "reason": control.reason,
                                                    "detail": failure(control)}))
        if control.ok:
            return self.roll_back(plugin, variant, step_id, out.reason or "probe_failed",
                                  f"{detail}; the last kept state passes it (control)")
        why = f"probe {spec.name} fails on the last kept state too (control: {failure(control)})"
        self.roll_back(plugin, variant, step_id, "environment_failed", f"{detail}; {why}")
        raise EnvironmentFailed(f"{why}; {plugin.id} was rolled back and nothing more staged: fix the environment, "
                                f"then `orchestrator run` continues from {plugin.id}")

    def candidate(self, verdict: Verdict, reason: str | None) -> Candidate:
        """Put the last kept state back while the other combinations are attempted; the best is shown again."""
        self.journal.show(verdict.step_id, "pre")
        self.store.set_step(verdict.step_id, state="candidate")
        return Candidate(verdict, reason)

    def keep(self, plugin: Plugin, best: Candidate) -> None:
        d = best.verdict.decision
        self.journal.show(best.step_id, "post")
        self.deployment.keep(plugin.id, best.step_id, best.reason,
                             describe(d) if d else "no throughput probe configured")
        self.measurer.adopt(best.verdict)
        self.reporter.outcome(plugin.id, "kept", best.reason, d.gain if d else None)

    def roll_back(self, plugin: Plugin, variant: Variant, step_id: int, reason: str, detail: str) -> None:
        """Restore every touched file, then run the plugin's own rollback steps in reverse."""
        self.reporter.phase(plugin.id, f"rollback ({reason})")
        self.store.set_step(step_id, state="rolling_back")
        self.journal.restore(step_id, exact=True)
        self.run.undo_steps(plugin, variant.params, step_id)
        self.store.finish_step(step_id, "rolled_back", reason, detail)
        self.reporter.outcome(plugin.id, "rolled_back", reason, None)
        return None
