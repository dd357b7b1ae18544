"""Re-measuring the deployment after plugins were judged one at a time: the final re-validation of the stack a run
kept, each kept plugin's contribution (leave-one-out), and the re-verification of decisions taken elsewhere.

Each comparison is a step whose pre-images are the deployment and whose post-images are the state compared with
it, so that recovery after a crash anywhere puts the deployment back. The compared state is the baseline arm and
the deployment the candidate, so a gain is the deployment's.
"""
from __future__ import annotations

import math
from typing import Callable

from orchestrator import decide
from orchestrator.context import RunContext
from orchestrator.deployment import Deployment
from orchestrator.images import same
from orchestrator.kept import KeptState
from orchestrator.noise import Noise
from orchestrator.pairing import choose
from orchestrator.plugin import Plugin
from orchestrator.policy import Policy
from orchestrator.prober import Arm, ArmFailed, Prober, Verdict, numbers
from orchestrator.stage import describe, guardrail_vetoes
from orchestrator.store import label, loads

MEASURED = "measured"  # outcome of a re-measurement step: it leaves the deployment as it was
FINAL = "(final)"  # the final re-validation's step is named so; its kind says what it is


class Restack:
    """Re-measurements of the kept stack: the final re-validation, attribution, re-verification. `noise`: the noise
    to judge by when asked (the Stager owns it: calibrated, then pooled over its decisions)."""

    def __init__(self, run: RunContext, prober: Prober, kept: KeptState, deployment: Deployment,
                 plugins: list[Plugin], noise: Callable[[], Noise | None] = lambda: None):
        self.run = run
        self.store = run.store
        self.journal = run.journal
        self.reporter = run.reporter
        self.prober = prober
        self.kept = kept
        self.deployment = deployment
        self.plugins = plugins
        self.noise = noise

    # comparison steps
    def switch_step(self, plugin: str, kind: str, images: list[tuple[dict, dict]], params: dict | None = None) -> int:
        """`images`: (row holding the deployed image, row whose pre-image is compared) per file."""
        step_id = self.store.new_step(self.run.run_id, plugin, "measuring", params=params, kind=kind,
                                      objective=self.prober.objective)
        self.journal.record(step_id, [dict(step_id=step_id, root=now["root"], path=now["path"],
                                   before=now["after"], before_mode=now["after_mode"],
                                   after=then["before"], after_mode=then["before_mode"], sealed=1)
                              for now, then in images
                              if not same((now["after"], now["after_mode"]), (then["before"], then["before_mode"]))])
        return step_id

    def compare(self, step_id: int, policy: Policy, name: str, without: set[str]) -> Verdict:
        """Pairs whatever the plugins' mode, the deployment (on disk, the kept state's arm) as the candidate; the
        target ends as deployed, with no live server up but the kept state's own, whatever happens. `without`: the
        kept plugins the compared state lacks."""
        policy = policy.model_copy(update={"interleave": True})
        deployed = list(self.deployment.rows())
        cand = self.kept.arm
        cand.holding, cand.show = deployed, lambda: self.journal.show(step_id, "pre")
        base = Arm([p for p in deployed if p not in without], lambda: self.journal.show(step_id, "post"))
        try:
            one_at_a_time = not self.run.project.target.pinnable({f["root"] for f in self.store.file_rows(step_id)})
            if one_at_a_time:
                self.kept.release()  # its server would outlive its files (Target.pinnable)
            keys = self.run.project.target.memory_keys()
            if keys and self.prober.configuration and self.kept.configuration is not None:
                base.put_on_disk()
                read, failed = self.prober.configuration_of(step_id, base, "baseline", name)
                cand.put_on_disk()
                one_at_a_time = one_at_a_time or failed is not None or self.kept.memory_changed(read, keys)
            pairing = choose(self.prober, policy, self.noise(), None, one_at_a_time)
            if pairing.mode == "sequential":
                self.kept.release()
            return pairing.measure(step_id, name, base, cand)
        finally:
            self.journal.show(step_id, "pre")
            if base.server is not None:
                base.server.stop()
            self.prober.release()

    def policy_across(self, without: set[str]) -> Policy:
        """The run's policy for a comparison across the kept plugins `without`, with the largest effect they declare
        (`accept: {implausible_factor: N}`, multiplied across them): the stack that holds max-num-seqs-256 (up to
        x300) against the one-sequence baseline is not implausible at x9, and re-measuring it cost fresh servers."""
        policy = self.run.project.policy
        declared = [p.manifest.accept.implausible_factor for p in self.plugins
                    if p.id in without and p.manifest.accept is not None
                    and p.manifest.accept.implausible_factor is not None]
        factor = math.prod(declared) if declared else policy.implausible_factor
        if factor <= policy.implausible_factor:
            return policy
        return policy.model_copy(update={"implausible_factor": factor})

    def measure_switch(self, plugin: str, kind: str, images: list[tuple[dict, dict]], phase: str,
                       without: set[str], policy: Policy) -> tuple[int, Verdict | None]:
        """A comparison step of the deployment against another state, which lacks the kept plugins `without`;
        None when an arm failed (recorded)."""
        step_id = self.switch_step(plugin, kind, images)
        name = label(self.store.step(step_id))
        self.reporter.phase(name, phase)
        try:
            return step_id, self.compare(step_id, policy, name, without)
        except ArmFailed as e:
            self.store.finish_step(step_id, MEASURED, e.reason, str(e))
            return step_id, None

    def record(self, step_id: int, verdict: Verdict, policy: Policy, reason: str | None, detail: str) -> None:
        self.prober.record(verdict, policy)
        self.store.finish_step(step_id, MEASURED, reason, detail, **numbers(verdict))
        self.reporter.outcome(label(self.store.step(step_id)), MEASURED, reason, verdict.decision.gain)

    # the stack a run kept
    def revalidate(self, kept: list[int]) -> None:
        """The whole stack the run kept (`kept`: its steps, in order) against the target as it was before the
        first of them."""
        first: dict[tuple[str, str], dict] = {}
        last: dict[tuple[str, str], dict] = {}
        for sid in kept:
            for f in self.deployment.files(sid):
                first.setdefault(self.journal.path(f), f)
                last[self.journal.path(f)] = f
        without = {self.store.step(sid)["plugin"] for sid in kept}
        policy = self.policy_across(without)
        step_id, verdict = self.measure_switch(FINAL, "final", [(last[k], first[k]) for k in last],
                                               "re-validating the kept stack", without, policy)
        if verdict is None:
            return
        d = verdict.decision
        better = d.verdict == "keep"
        detail = f"kept stack against the run's baseline: {describe(d)}"
        self.record(step_id, verdict, policy, None if better else "stack_not_better", detail)
        if not better:
            self.store.event(self.run.run_id, "warning", f"the kept stack as a whole is not better than the baseline "
                                                         f"({detail}); nothing was rolled back", step_id)

    def attribute(self, kept: list[int]) -> None:
        """Leave-one-out: each plugin the run kept, switched to its pre-images, against the whole stack."""
        for sid in kept:
            plugin_id = self.store.step(sid)["plugin"]
            clashes = self.deployment.clashes(sid)
            if clashes:
                step_id = self.store.new_step(self.run.run_id, plugin_id, "done", kind="attribution")
                self.store.finish_step(step_id, MEASURED, "not_separable",
                                       f"later kept plugins changed the same files: {'; '.join(clashes)}")
                self.reporter.outcome(label(self.store.step(step_id)), MEASURED, "not_separable", None)
                continue
            policy = self.policy_across({plugin_id})
            step_id, verdict = self.measure_switch(plugin_id, "attribution", [(f, f) for f in self.deployment.files(sid)],
                                                   "leave-one-out", {plugin_id}, policy)
            if verdict is None:
                continue
            self.record(step_id, verdict, policy, None,
                        f"contribution of {plugin_id} to the stack: {describe(verdict.decision)}")

    # decisions measured in another environment
    def reverify(self) -> None:
        """Re-judge each kept plugin whose decision was measured under another fingerprint: its pre-images
        against its post-images, interleaved; keep it (re-recorded under this environment) or roll it back."""
        from orchestrator.fingerprint import describe as describe_change, is_stale
        from orchestrator.prober import fingerprint
        current = fingerprint()
        by_id = {p.id: p for p in self.plugins}
        for plugin_id, row in self.deployment.rows().items():
            sid = row["step_id"]
            recorded = self.store.fingerprint_of(sid)
            if recorded is None or current is None or not is_stale(recorded, current):
                continue
            why = describe_change(recorded, current)
            plugin = by_id.get(plugin_id)
            problem = None
            if plugin is None:
                problem = ("not_applicable", "its plugin folder is gone")
            elif changed := self.deployment.drifted(sid):
                problem = ("files_changed", f"files changed since it was kept: {', '.join(changed)}")
            elif clashes := self.deployment.clashes(sid):
                problem = ("not_separable", f"later kept plugins changed the same files: {'; '.join(clashes)}")
            if problem:
                step_id = self.store.new_step(self.run.run_id, plugin_id, "done", params=loads(row["params"]),
                                              kind="reverify")
                self.store.finish_step(step_id, "skipped", problem[0], f"stale ({why}) but {problem[1]}")
                self.reporter.outcome(plugin_id, "skipped", problem[0], None)
                continue
            self.rejudge(plugin, row, why)

    def rejudge(self, plugin: Plugin, row: dict, why: str) -> None:
        params = loads(row["params"])
        step_id = self.switch_step(plugin.id, "reverify", [(f, f) for f in self.deployment.files(row["step_id"])],
                                   params)
        policy = self.run.project.policy.merged(plugin.manifest.accept)
        self.reporter.phase(plugin.id, "re-verify")
        try:
            verdict = self.compare(step_id, policy, plugin.id, {plugin.id})
        except ArmFailed as e:
            self.store.finish_step(step_id, MEASURED, e.reason, f"stale ({why}); re-verification failed, left kept: {e}")
            return
        d = verdict.decision
        vetoes = guardrail_vetoes(policy, verdict)
        self.prober.record(verdict, policy, vetoes)
        detail = f"re-judged after {why}: {describe(d)}"
        outcome, reason = decide.outcome(d, vetoes, policy)
        if outcome == "kept":
            self.deployment.replace(plugin.id, row, step_id, "reverified", detail, **numbers(verdict))
            self.reporter.outcome(plugin.id, "kept", "reverified", d.gain)
            return
        self.journal.show(step_id, "post")
        self.kept.release()  # it served the deployment as it was
        self.run.undo_steps(plugin, params, step_id)
        dependents = [p.id for p in self.plugins if plugin.id in p.manifest.requires and p.id in self.deployment]
        self.deployment.remove(plugin.id, step_id, reason,
                               detail + ("; vetoed: " + "; ".join(vetoes) if vetoes else ""), **numbers(verdict))
        if dependents:
            self.store.event(self.run.run_id, "warning", f"{plugin.id} rolled back; still kept although they require "
                                                         f"it: {', '.join(dependents)}", step_id)
        self.reporter.outcome(plugin.id, "rolled_back", reason, d.gain)
