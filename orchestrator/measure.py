"""Measuring whatever is on disk: probe runs, one sample of an arm, and samples in A B / B A pairs (or against
reused baseline samples) until the judge decides. The caller switches the images; this module never changes
the target."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from orchestrator import decide
from orchestrator.config import Policy, ProbeSpec
from orchestrator.context import RunContext
from orchestrator.plugin import NUMERICS_ENV, Plugin, numerics_env
from orchestrator.probes.runner import ProbeResult, ProcessResult, judge_output, run_process
from orchestrator.state_server import ServerFailed, StateServer
from orchestrator.store import dumps

# A throughput sample's pair index (its `repeat`), for probes: the serving probe offsets its workload's seed by
# it, so both samples of a pair send the same prompts and no two pairs do. A server that serves the last sample
# of one pair and the first of the next (A B, B A) thus never finds the earlier sample's prompts in its prefix
# cache, which would make the later sample faster than its partner on a fresh server.
PAIR_ENV = "ORCHESTRATOR_PAIR"


class BaselineFailed(Exception):
    """The run's baseline cannot be measured: nothing can be judged against it."""


class EnvironmentFailed(Exception):
    """A probe the candidate failed fails on the last kept state too: the run stops, blaming no plugin."""


class ArmFailed(Exception):
    """A throughput probe failed while measuring one arm; `reason` is the probe's (timeout, crashed, ...)."""

    def __init__(self, reason: str, message: str, spec: ProbeSpec, result: ProbeResult):
        super().__init__(message)
        self.reason = reason
        self.spec = spec
        self.result = result


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


def describe(d: decide.Decision) -> str:
    gain = "n/a" if d.gain is None else f"{d.gain:+.2%}"
    notes = f"; {'; '.join(d.notes)}" if d.notes else ""
    return f"{d.verdict}: gain {gain} over {d.n_baseline}/{d.n_candidate} samples ({d.rule} rule){notes}"


def numbers(v: Verdict) -> dict[str, Any]:
    """The step's columns for a verdict: gain, objective before and after, metric medians of each arm."""
    d = v.decision
    return dict(gain=d.gain if d else None,
                before_value=d.baseline_median if d else None, after_value=d.candidate_median if d else None,
                metrics=dumps(medians([s.metrics for s in v.cand])) if v.cand else None,
                baseline_metrics=dumps(medians([s.metrics for s in v.base])) if v.base else None)


def guardrail_vetoes(policy: Policy, verdict: Verdict) -> list[str]:
    return decide.check_guardrails(policy.guardrails, [s.metrics for s in verdict.base],
                                   [s.metrics for s in verdict.cand])


def fingerprint() -> dict | None:
    try:
        from orchestrator.fingerprint import environment
        return environment()
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 - a broken fingerprint must not stop a measurement
        return {"error": repr(e)}


class Measurer:
    """Runs the project's probes for one run. `kept_samples` are the last kept state's samples, which the
    sequential mode reuses as the baseline arm of the next candidate. `server` is the live server of the state on
    disk that the target's probes share (state_server.py); the caller switches states, and `release` stops it."""

    def __init__(self, run: RunContext, plugins: Iterable[Plugin] = ()):
        self.run = run
        self.store = run.store
        probes = run.project.probes
        self.correctness = [p for p in probes if p.role == "correctness"]
        self.throughput = [p for p in probes if p.role == "throughput"]
        self.objective = self.throughput[0].objective if self.throughput else None
        self.kept_samples: list[Sample] | None = None
        self.plugins = {p.id: p for p in plugins}
        self.holding: dict[str, list[str]] = {"baseline": [], "candidate": []}
        self.server = StateServer(run)

    def hold(self, baseline: Iterable[str], candidate: Iterable[str]) -> None:
        """The plugins (ids) that each arm's state holds; the control arm is the baseline's state. Probes of a
        state holding a plugin that declares `changes_numerics` are told so (NUMERICS_ENV)."""
        self.holding = {"baseline": list(dict.fromkeys(baseline)), "candidate": list(dict.fromkeys(candidate))}

    def release(self) -> None:
        """Stop the live server of the state on disk, if one is up."""
        self.server.stop()

    def env(self, spec: ProbeSpec, arm: str, repeat: int, plugin: str) -> dict[str, str]:
        env = self.run.env(plugin)
        env.pop(NUMERICS_ENV, None)
        env.pop(PAIR_ENV, None)
        held = self.holding.get("baseline" if arm == "control" else arm, [])
        env.update(numerics_env([self.plugins[i] for i in held if i in self.plugins]))
        if spec.role == "throughput":
            env[PAIR_ENV] = str(repeat)
        return env

    def probe(self, spec: ProbeSpec, step_id: int | None, arm: str, repeat: int, plugin: str) -> ProbeResult:
        """Run one probe on the state on disk and store its measurement. A probe that talks to a server is aimed
        at the live server of this state (started when none is up); any other runs with no server alive."""
        self.run.reporter.phase(plugin, f"probe {spec.name} ({arm} #{repeat + 1})")
        env = self.env(spec, arm, repeat, plugin)
        command = spec.command
        if self.server.serves(spec):
            started = time.monotonic()
            try:
                command = self.server.aim(spec, env, step_id, arm, plugin).command
            except ServerFailed as e:
                return self.server_failed(spec, e, step_id, arm, repeat, time.monotonic() - started)
            self.run.reporter.phase(plugin, f"probe {spec.name} ({arm} #{repeat + 1})")
        else:
            self.server.stop()  # the probe may need the device to itself
        on_start = self.run.recorder(step_id)
        result = run_process(command, self.run.project.base_dir, env, spec.timeout,
                             on_start=lambda pid, ct: on_start(f"probe {spec.name}", pid, ct),
                             on_tick=self.run.tick, tmp_dir=self.run.tmp)
        out = judge_output(spec.role, spec.objective, result, spec.timeout)
        if not out.ok and self.server.serves(spec):
            if crash := self.server.crashed():
                out.reason, out.message = "crashed", f"{out.message}; {crash}"
            self.server.stop()  # a server that misbehaved is not reused: the next probe starts another
        self.store.add_measurement(run_id=self.run.run_id, step_id=step_id, probe=spec.name, role=spec.role, arm=arm,
                                   repeat=repeat, ok=int(out.ok), reason=out.reason, value=out.value,
                                   metrics=out.metrics, duration=result.duration, returncode=result.returncode,
                                   stdout_tail=result.stdout_tail, stderr_tail=result.stderr_tail,
                                   fingerprint=fingerprint() if spec.role == "throughput" else None)
        return out

    def server_failed(self, spec: ProbeSpec, e: ServerFailed, step_id: int | None, arm: str, repeat: int,
                      waited: float) -> ProbeResult:
        """The live server a probe needed did not start: that probe's failure, `crashed` or `timeout`, stored with
        the server log's tail as its output and the time spent waiting for it as its duration."""
        message = f"the live server did not start: {e.summary}"
        tail = e.tail[-4000:]
        out = ProbeResult(False, e.reason, message, {"error": message, "reason": e.reason},
                          process=ProcessResult(None, e.reason == "timeout", waited, tail, ""))
        self.store.add_measurement(run_id=self.run.run_id, step_id=step_id, probe=spec.name, role=spec.role, arm=arm,
                                   repeat=repeat, ok=0, reason=out.reason, value=None, metrics=out.metrics,
                                   duration=waited, returncode=None, stdout_tail=tail, stderr_tail="",
                                   fingerprint=None)
        return out

    def failed_correctness(self, step_id: int | None, arm: str, plugin: str) -> tuple[ProbeSpec, ProbeResult] | None:
        """The first correctness probe that fails on the state on disk, with its result; None when all pass."""
        for spec in self.correctness:
            out = self.probe(spec, step_id, arm, 0, plugin)
            if not out.ok:
                return spec, out
        return None

    def control(self, spec: ProbeSpec, step_id: int, plugin: str) -> ProbeResult:
        """Re-run a probe the candidate failed on the last kept state, which the caller has put on disk."""
        return self.probe(spec, step_id, "control", 0, plugin)

    def sample(self, step_id: int | None, arm: str, repeat: int, plugin: str) -> Sample:
        """One measurement of the state on disk: every throughput probe once, metrics merged."""
        metrics: dict[str, Any] = {}
        value = None
        for spec in self.throughput:
            out = self.probe(spec, step_id, arm, repeat, plugin)
            if not out.ok:
                raise ArmFailed(out.reason or "probe_failed", f"{arm} arm, probe {spec.name}: {failure(out)}", spec, out)
            metrics.update({k: v for k, v in out.metrics.items() if k not in metrics})
            if value is None:
                value = out.value
        return Sample(value, metrics)

    def baseline(self, kept: Iterable[str] = ()) -> None:
        """The correctness probes once (a failure is a warning) and `repeats` throughput samples of the target as
        the run finds it (holding the plugins `kept`); BaselineFailed when a sample cannot be taken."""
        self.hold(kept, kept)
        try:
            for spec in self.correctness:
                out = self.probe(spec, None, "baseline", 0, "baseline")
                if not out.ok:
                    self.store.event(self.run.run_id, "warning",
                                     f"baseline fails correctness probe {spec.name}: {out.message}")
            if not self.throughput:
                return
            try:
                samples = [self.sample(None, "baseline", i, "baseline")
                           for i in range(self.run.project.policy.repeats)]
            except ArmFailed as e:
                raise BaselineFailed(f"cannot measure the baseline: {e}") from None
        finally:
            self.release()
        self.kept_samples = samples
        self.store.update_run(self.run.run_id, baseline=dumps(medians([s.metrics for s in samples])))

    def measure(self, step_id: int, policy: Policy, name: str, show: Callable[[str], None]) -> Verdict:
        """The candidate (images `post`) against the last kept state (`pre`): interleaved pairs until the judge
        decides, or the kept state's samples reused against candidate samples added one at a time."""
        if policy.interleave:
            return self.interleaved(step_id, policy, name, lambda: show("pre"), lambda: show("post"))
        judge = decide.Judge(policy)
        if self.kept_samples is None:
            show("pre")
            self.kept_samples = [self.sample(step_id, "baseline", i, name) for i in range(policy.repeats)]
            show("post")
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

    def interleaved(self, step_id: int | None, policy: Policy, name: str, show_base: Callable[[], None],
                    show_cand: Callable[[], None]) -> Verdict:
        """Pairs until the judge decides. The candidate is on disk when this is called (its correctness probes
        just ran, or it is the deployment a re-measurement compares), so the first pair measures it first and
        each later pair reverses the order of the one before (C B, B C, C B, ...): a lag within a pair (warm
        caches, a drifting clock, a server that served the pair before) favours each arm equally often, and
        consecutive pairs share a state, switched only when the arm changes, so one live server start serves
        the last sample of a pair and the first of the next."""
        judge = decide.Judge(policy)
        base: list[Sample] = []
        cand: list[Sample] = []
        on_disk = "candidate"
        while True:
            n = len(base)
            arms = [("candidate", show_cand, cand), ("baseline", show_base, base)]
            for arm, show, samples in (arms if n % 2 == 0 else arms[::-1]):
                if arm != on_disk:
                    show()
                    on_disk = arm
                samples.append(self.sample(step_id, arm, n, name))
            d = judge.decide([s.value for s in base], [s.value for s in cand], final=n + 1 >= policy.max_pairs)
            if d is not None:
                return Verdict(step_id, d, base, cand)

    def adopt(self, verdict: Verdict) -> None:
        """A candidate was kept: its samples are now the kept state's."""
        if verdict.cand:
            self.kept_samples = verdict.cand

    def record(self, verdict: Verdict, policy: Policy, vetoes: Sequence[str] = ()) -> None:
        """Store the decision, the policy it was taken under and any guardrail vetoes."""
        self.store.add_decision(self.run.run_id, verdict.step_id, self.objective, verdict.decision.to_dict(),
                                list(vetoes), policy.model_dump())
