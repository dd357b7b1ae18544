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
from orchestrator.guardrails import check_guardrails
from orchestrator.images import TouchError
from orchestrator.kept import KeptState
from orchestrator.noise import Noise, folded
from orchestrator.pairing import Together, choose
from orchestrator.plugin import Plugin, Variant
from orchestrator.prober import (Arm, ArmFailed, BaselineFailed, EnvironmentFailed, Prober, Verdict, failure, medians,
                                 numbers)
from orchestrator.probes.runner import ProbeResult
from orchestrator.reconcile import Reconciler, Unstacked
from orchestrator.recovery import describe_left, undo
from orchestrator.state_server import StateServer
from orchestrator.steps import StepFailed, apply_all, check
from orchestrator.targets.base import SIDE_BY_SIDE
from orchestrator.store import dumps


def describe(d: decide.Decision) -> str:
    gain = "n/a" if d.gain is None else f"{d.gain:+.2%}"
    interval = (f" [{d.ci_low:+.2%}, {d.ci_high:+.2%}]" if d.ci_low is not None and d.ci_high is not None else "")
    starts = f", {d.starts[0]}+{d.starts[1]} server starts" if d.starts else ""
    if d.between:
        starts += f", counting {d.between:.2%} between starts ({d.between_df} df)"
    notes = f"; {'; '.join(d.notes)}" if d.notes else ""
    return f"{d.verdict}: gain {gain}{interval} over {d.n_baseline}/{d.n_candidate} samples{starts} ({d.rule} rule){notes}"


def guardrail_vetoes(policy, verdict: Verdict) -> list[str]:
    """What vetoes a keep: the policy's guardrails, and a gain that stayed implausible."""
    return check_guardrails(policy.guardrails, [s.metrics for s in verdict.base],
                                   [s.metrics for s in verdict.cand]) + decide.implausible_veto(verdict.decision, policy)


def plugins_own(error: Exception) -> bool:
    """Whether an unforeseen error is the staged plugin's alone: not the machine's (a full disk, the database)
    nor the state folder's (UserError: a damaged blob), which stop the run instead."""
    return not (isinstance(error, (EnvironmentFailed, UserError)) or is_environment(error))


@dataclass
class Candidate:
    """An attempt that may be kept. Its step is in state `candidate` and the last kept state is on disk; its
    own live server, where the pairing gave it one, is still alive (it becomes the kept state's)."""
    verdict: Verdict
    reason: str | None  # the reason it would be kept with: None, or inconclusive (on_inconclusive: keep)
    arm: Arm
    configuration: dict | None = None

    def release(self) -> None:
        if self.arm.server is not None:
            self.arm.server.stop()

    @property
    def step_id(self) -> int:
        return self.verdict.step_id

    @property
    def gain(self) -> float:
        d = self.verdict.decision
        return d.gain if d and d.gain is not None else 0


class Stager:
    """Stages plugins against the last kept state, which the run loop owns and passes in (`kept`)."""

    def __init__(self, run: RunContext, prober: Prober, kept: KeptState, deployment: Deployment,
                 noise: Noise | None = None):
        self.run = run
        self.store = run.store
        self.journal = run.journal
        self.reporter = run.reporter
        self.prober = prober
        self.kept = kept
        self.deployment = deployment
        self.noise = noise
        self.reconciler: Reconciler | None = None
        self.renewals: dict[str, Unstacked] = {}

    def settle(self, plugins: list[Plugin], staged: set[str]) -> None:
        """Before anything is measured: kept plugins whose files changed since are undone for real where their
        change is no longer in place, and marked for a renewed record where it is (reconcile.py)."""
        self.reconciler = Reconciler(self.run, self.deployment, plugins, staged)
        self.renewals = self.reconciler.settle()

    def baseline(self) -> None:
        """The state the run starts from: its configuration probes and correctness probes once (a failure is a
        warning) and `repeats` throughput samples (on a live server that stays up as the kept state's, where the
        pairing keeps one); BaselineFailed when a sample cannot be taken."""
        arm = self.kept.arm
        arm.holding, arm.show = list(self.deployment.rows()), None
        if self.run.pairing != "sequential" and any(self.prober.serves(s) for s in self.prober.throughput):
            arm.server = StateServer(self.run, pinned=self.run.pairing)
            if self.run.pairing in SIDE_BY_SIDE and self.prober.configuration:
                try:  # it starts while the configuration probes run, as a candidate's does
                    self.prober.start(arm, "baseline", None, 0, "baseline", wait=False)
                except ArmFailed:
                    arm.server = StateServer(self.run, pinned=self.run.pairing)  # its first probe starts another
        early = self.prober.before_configuration()
        for spec in early:
            self.baseline_check(spec, arm)
        if self.prober.configuration:
            read, failed = self.prober.configuration_of(None, arm, "baseline", "baseline")
            if failed:
                self.store.event(self.run.run_id, "warning", f"baseline fails configuration probe {failed[0].name}: "
                                 f"{failed[1].message}; every candidate is measured")
            self.kept.configuration = None if failed else read
        for spec in (s for s in self.prober.correctness if s not in early):
            self.baseline_check(spec, arm)
        if not self.prober.throughput:
            return
        try:
            samples = [self.prober.sample(None, arm, "baseline", i, "baseline")
                       for i in range(self.run.project.policy.repeats)]
        except ArmFailed as e:
            self.kept.release()
            raise BaselineFailed(f"cannot measure the baseline: {e}") from None
        finally:
            self.prober.release()
        self.kept.samples = samples
        self.store.update_run(self.run.run_id, baseline=dumps(medians([s.metrics for s in samples])))

    def baseline_check(self, spec: ProbeSpec, arm: Arm) -> None:
        """A correctness probe on the state the run starts from: a failure is a warning."""
        out = self.prober.probe(spec, None, arm, "baseline", 0, "baseline")
        if not out.ok:
            self.store.event(self.run.run_id, "warning", f"baseline fails correctness probe {spec.name}: {out.message}")

    def stage(self, plugin: Plugin) -> None:
        """Skip it, find it already applied, or attempt every params combination and keep the best candidate."""
        if self.checked(plugin):
            self.choose(plugin, plugin.variants)

    def checked(self, plugin: Plugin) -> bool:
        """`ready`, an unforeseen error in its checks failing this plugin only."""
        try:
            return self.ready(plugin)
        except Exception as e:
            if not plugins_own(e):
                raise
            self.unexpected(plugin, None, e)
            return False

    def choose(self, plugin: Plugin, variants: list[Variant]) -> int | None:
        """Attempt these params combinations and keep the best candidate; the kept step, if any."""
        candidates: list[Candidate] = []
        try:
            for variant in variants:
                try:
                    candidate = self.attempt(plugin, variant)
                except Exception as e:
                    if not plugins_own(e):
                        raise
                    candidate = self.unexpected(plugin, variant, e)
                if candidate is not None:
                    candidates.append(candidate)
                    for c in candidates:  # only the best so far may become the kept state: its server alone lives
                        if c is not max(candidates, key=lambda c: c.gain):
                            c.release()
        except EnvironmentFailed:
            for c in candidates:  # the last kept state is on disk: close them undecided
                c.release()
                self.store.finish_step(c.step_id, "rolled_back", "environment_failed",
                                       "not chosen: the run stopped on an environment failure")
            raise
        if not candidates:
            return None
        best = max(candidates, key=lambda c: c.gain)
        for c in candidates:
            if c is not best:
                d = c.verdict.decision
                self.outperformed(plugin, c.step_id, best.step_id, d.gain if d else None)
        self.keep(plugin, best)
        return best.step_id

    def outperformed(self, plugin: Plugin, step_id: int, best: int, gain: float | None, **fields) -> None:
        self.store.finish_step(step_id, "rolled_back", "outperformed", f"another candidate gained more (step {best})",
                               **fields)
        self.reporter.outcome(plugin.id, "rolled_back", "outperformed", gain)

    def unexpected(self, plugin: Plugin, variant: Variant | None, error: Exception) -> None:
        """An error nothing foresaw (a bug, an odd file) fails this plugin only: its open step is rolled back with
        the reason of the phase it was in and a one-line description; the traceback goes to the events."""
        step = next((s for s in self.store.open_steps() if s["run_id"] == self.run.run_id and s["kind"] == "attempt"
                     and s["plugin"] == plugin.id and s["state"] != "candidate"), None)
        what = " ".join(f"{type(error).__name__}: {error}".split())[:500]
        if step is None or variant is None:
            step_id = step["id"] if step else self.store.new_step(self.run.run_id, plugin.id, "applying")
            self.store.event(self.run.run_id, "error", f"{plugin.id}: {traceback.format_exc()}", step_id)
            left = undo(self.store, self.journal, step_id) if step is not None else []
            self.store.finish_step(step_id, "rolled_back", "apply_failed", f"unexpected error: {what}" + self.named(
                plugin, step_id, left))
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
        missing = [r for r in m.requires if not (self.deployment.holds(r) or r in self.renewals)]
        if missing:
            return self.skip(plugin, "dependency_not_kept", f"requires {', '.join(missing)}, not kept")
        earlier = self.deployment.rows().get(plugin.id)
        if earlier:  # its change is in place: `settle` undid before the baseline what was not
            return self.already_applied(plugin, earlier, self.renewals.get(plugin.id))
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

    def already_applied(self, plugin: Plugin, earlier: dict, renewal: Unstacked | None = None) -> bool:
        """Kept earlier and in place. With a `renewal` its files changed since around its change: this step, holding
        them as they are with and without its change, becomes its record."""
        original = self.store.step(earlier["step_id"])
        fields = {k: original[k] for k in ("params", "gain", "objective", "before_value", "after_value", "metrics",
                                           "baseline_metrics")}
        step_id = self.store.new_step(self.run.run_id, plugin.id, "done", params=None)
        if renewal is None:
            self.store.finish_step(step_id, "kept", "already_applied",
                                   f"kept in run {original['run_id']}; its files are unchanged", **fields)
        else:
            self.reconciler.renew(renewal, step_id)
            self.deployment.renew(plugin.id, earlier, step_id, "already_applied",
                                  f"kept in run {original['run_id']}; {', '.join(renewal.changed)} changed since and "
                                  "its change is still in place: its record now holds the later edit", **fields)
        self.reporter.outcome(plugin.id, "kept", "already_applied", original["gain"])
        return False

    def attempt(self, plugin: Plugin, variant: Variant) -> Candidate | None:
        """Stage one params combination on the last kept state. Returns the candidate, or None when it was rolled
        back (its outcome recorded); either way the last kept state is on disk afterwards, and no live server is
        left up but the kept state's and a returned candidate's own."""
        cand = Arm([])
        try:
            result = self.judge(plugin, variant, cand)
        finally:
            self.prober.release()
        if result is None and cand.server is not None:
            cand.server.stop()
        return result

    def judge(self, plugin: Plugin, variant: Variant, cand: Arm) -> Candidate | None:
        name = plugin.id + (f" [{variant.label}]" if variant.params else "")
        kind = self.run.kind
        target = self.run.project.target
        first_root = next(iter(target.roots))
        pinnable = target.pinnable({s.root or first_root for s in variant.apply if s.runs_on(kind)})
        if not pinnable:
            self.kept.release()  # its server would outlive its files (Target.pinnable)
        step_id = self.store.new_step(self.run.run_id, plugin.id, "applying", params=variant.params, image="post",
                                      objective=self.prober.objective)
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
        kept_ids = list(self.deployment.rows())
        base = self.kept.arm
        base.holding, base.show = kept_ids, lambda: self.journal.show(step_id, "pre")
        cand.holding, cand.show = [*kept_ids, plugin.id], lambda: self.journal.show(step_id, "post")
        found = self.configured(plugin, variant, step_id, name, cand, pinnable, policy)
        if found is None:
            return None  # rolled back before any pair
        read, early = found
        one_at_a_time = not pinnable or (read is not None and self.kept.memory_changed(read, target.memory_keys()))
        pairing = choose(self.prober, policy, self.noise, self.kept.samples, one_at_a_time)
        if isinstance(pairing, Together):
            if cand.server is None or cand.server.pinned != pairing.mode:
                cand.server = StateServer(self.run, pinned=pairing.mode)  # its correctness probes talk to it too
        else:
            if cand.server is not None:
                cand.server.stop()
                cand.server = None
            self.kept.release()  # one server at a time
        with pairing.meanwhile(step_id, name, base, cand):
            failed = self.prober.failed_correctness(step_id, cand, "candidate", name,
                                                    [s for s in self.prober.correctness if s not in early])
        if failed:
            spec, out = failed
            return self.probe_failed(plugin, variant, step_id, name, spec, out, f"probe {spec.name}: {failure(out)}")
        if not self.prober.throughput:
            return self.candidate(Verdict(step_id, None), None, cand, read)
        self.store.set_step(step_id, state="measuring")
        try:
            verdict = pairing.measure(step_id, name, base, cand)
        except ArmFailed as e:
            return self.probe_failed(plugin, variant, step_id, name, e.spec, e.result, str(e))
        if pairing.mode == "reused":
            self.kept.samples = pairing.kept_samples
        if self.noise is not None and pairing.mode != "reused" and getattr(verdict.decision, "rule", None) == "stat":
            self.noise = folded(self.noise, *verdict.server_pairs())  # the next decisions judge by the pooled spread
        vetoes = guardrail_vetoes(policy, verdict)
        self.prober.record(verdict, policy, vetoes)
        self.store.set_step(step_id, state="deciding", **numbers(verdict))
        outcome, reason = decide.outcome(verdict.decision, vetoes, policy)
        if outcome == "rolled_back":
            detail = "; ".join(vetoes) if reason == "guardrail" else describe(verdict.decision)
            self.kept.remember(read, name, step_id, reason)
            return self.roll_back(plugin, variant, step_id, reason, detail)
        return self.candidate(verdict, reason, cand, read)

    def configured(self, plugin: Plugin, variant: Variant, step_id: int, name: str, cand: Arm, pinnable: bool,
                   policy) -> tuple[dict | None, list[ProbeSpec]] | None:
        """Before any pair: the candidate's configuration read (and the correctness probes that must precede it),
        its server started where the pairing keeps one. Returns (the reading, the correctness probes already
        passed), or None when the candidate was rolled back: a probe failed, or its configuration says that
        measuring it would measure noise."""
        read: dict | None = None
        pinned = self.run.pairing
        interleave = self.run.project.policy.interleave
        if (pinned in SIDE_BY_SIDE and self.prober.configuration
                and interleave and any(self.prober.serves(s) for s in self.prober.throughput)):
            # the candidate's own server starts while its configuration probe runs (a start costs seconds on a
            # GPU, and a server that served only the correctness probes serves the pairs too); a candidate that
            # turns out unmeasured, or to be measured one server at a time, stops it
            cand.server = StateServer(self.run, pinned=pinned)
            try:
                self.prober.start(cand, "candidate", step_id, 0, name, wait=False)
            except ArmFailed:
                cand.server = None  # the correctness probe starts it again, and fails as the probe it is
        early = self.prober.before_configuration()
        if early and (failed := self.prober.failed_correctness(step_id, cand, "candidate", name, early)):
            spec, out = failed
            return self.probe_failed(plugin, variant, step_id, name, spec, out, f"probe {spec.name}: {failure(out)}")
        if self.prober.reads_server and pinned == "sleeping" and pinnable and interleave:
            cand.server = StateServer(self.run, pinned=pinned)  # the server its configuration is read from is measured
        if self.prober.configuration:
            read, failed = self.prober.configuration_of(step_id, cand, "candidate", name)
            if failed:
                spec, out = failed
                return self.probe_failed(plugin, variant, step_id, name, spec, out, f"probe {spec.name}: {failure(out)}")
            if (ignored := self.kept.ignored(read)) is not None:
                return self.no_effect(plugin, variant, step_id, policy, ignored)
            if earlier := self.kept.judged_like(read):
                other, other_step, reason = earlier
                return self.roll_back(plugin, variant, step_id, reason,
                                      f"runs what {other} ran (step {other_step}; the configuration probes read the "
                                      f"same), which was rolled back as {reason} against this same kept state: not "
                                      "measured again")
        return read, early

    def no_effect(self, plugin: Plugin, variant: Variant, step_id: int, policy, ignored: dict[str, str]) -> None:
        """The candidate changes nothing the target runs here (its configuration probes read what the last kept
        state's read): no measurement could tell them apart but by noise, so it is rolled back as no_gain unmeasured,
        with what the target said it ignores."""
        why = "; ".join(f"{k}: {v}" for k, v in ignored.items())
        note = ("no effect here: the configuration probes read the same effective configuration as on the last "
                "kept state" + (f" (ignored: {why})" if why else ""))[:1500]
        d = decide.Decision("no_gain", None, rule="configuration", notes=[note], min_gain=policy.min_gain)
        self.prober.record(Verdict(step_id, d), policy)
        self.store.set_step(step_id, state="deciding")
        return self.roll_back(plugin, variant, step_id, "no_gain", describe(d))

    def probe_failed(self, plugin: Plugin, variant: Variant, step_id: int, name: str, spec: ProbeSpec,
                     out: ProbeResult, detail: str) -> None:
        """A probe failed while the candidate was on disk: re-run it on the last kept state, the control (as
        Kayenta judges a canary against a control, not against history). When the control passes, the failure is
        the candidate's; when it fails too, the environment is at fault: roll back as environment_failed and
        stop the run (EnvironmentFailed)."""
        self.journal.show(step_id, "pre")
        control = self.prober.probe(spec, step_id, self.kept.arm, "control", 0, f"(control of {name})")
        self.store.set_step(step_id, control=dumps({"probe": spec.name, "passed": control.ok, "reason": control.reason,
                                                    "detail": failure(control)}))
        if control.ok:
            return self.roll_back(plugin, variant, step_id, out.reason or "probe_failed",
                                  f"{detail}; the last kept state passes it (control)")
        why = f"probe {spec.name} fails on the last kept state too (control: {failure(control)})"
        self.roll_back(plugin, variant, step_id, "environment_failed", f"{detail}; {why}")
        raise EnvironmentFailed(f"{why}; {plugin.id} was rolled back and nothing more staged: fix the environment, "
                                f"then `orchestrator run` continues from {plugin.id}")

    def candidate(self, verdict: Verdict, reason: str | None, arm: Arm, read: dict | None) -> Candidate:
        """Put the last kept state back while the other combinations are attempted; the best is shown again."""
        self.journal.show(verdict.step_id, "pre")
        self.store.set_step(verdict.step_id, state="candidate")
        return Candidate(verdict, reason, arm, read)

    def keep(self, plugin: Plugin, best: Candidate) -> None:
        d = best.verdict.decision
        self.journal.show(best.step_id, "post")
        self.deployment.keep(plugin.id, best.step_id, best.reason,
                             describe(d) if d else "no throughput probe configured")
        self.kept.adopt(list(self.deployment.rows()), best.verdict.cand, best.configuration, best.arm.server)
        self.reporter.outcome(plugin.id, "kept", best.reason, d.gain if d else None)

    def roll_back(self, plugin: Plugin, variant: Variant, step_id: int, reason: str, detail: str) -> None:
        """Put back what the attempt changed, then run the plugin's own rollback steps in reverse; what others
        changed in the target meanwhile stays, and is named."""
        self.reporter.phase(plugin.id, f"rollback ({reason})")
        self.store.set_step(step_id, state="rolling_back")
        left = undo(self.store, self.journal, step_id)
        self.run.undo_steps(plugin, variant.params, step_id)
        self.store.finish_step(step_id, "rolled_back", reason, detail + self.named(plugin, step_id, left))
        self.reporter.outcome(plugin.id, "rolled_back", reason, None)
        return None

    def named(self, plugin: Plugin, step_id: int, left: list) -> str:
        """What a rollback left as it is (others' changes), as an event and as a note for the step's detail."""
        if not left:
            return ""
        self.store.event(self.run.run_id, "left", f"{plugin.id}: rolled back; left as they are: {describe_left(left)}",
                         step_id)
        return f"; left as they are: {describe_left(left)}"
