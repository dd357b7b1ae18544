"""Measuring whatever is on disk: probe runs, one sample of an arm, and samples in A B / B A pairs (or against
reused baseline samples) until the judge decides. The caller switches the images; this module never changes
the target."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from orchestrator import decide
from orchestrator.config import Policy, ProbeSpec
from orchestrator.context import RunContext
from orchestrator.probes.runner import ProbeResult, judge_output, run_process
from orchestrator.store import dumps


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
    sequential mode reuses as the baseline arm of the next candidate."""

    def __init__(self, run: RunContext):
        self.run = run
        self.store = run.store
        probes = run.project.probes
        self.correctness = [p for p in probes if p.role == "correctness"]
        self.throughput = [p for p in probes if p.role == "throughput"]
        self.objective = self.throughput[0].objective if self.throughput else None
        self.kept_samples: list[Sample] | None = None

    def probe(self, spec: ProbeSpec, step_id: int | None, arm: str, repeat: int, plugin: str) -> ProbeResult:
        self.run.reporter.phase(plugin, f"probe {spec.name} ({arm} #{repeat + 1})")
        on_start = self.run.recorder(step_id)
        result = run_process(spec.command, self.run.project.base_dir, self.run.env(plugin), spec.timeout,
                             on_start=lambda pid, ct: on_start(f"probe {spec.name}", pid, ct),
                             on_tick=self.run.tick, tmp_dir=self.run.tmp)
        out = judge_output(spec.role, spec.objective, result, spec.timeout)
        self.store.add_measurement(run_id=self.run.run_id, step_id=step_id, probe=spec.name, role=spec.role, arm=arm,
                                   repeat=repeat, ok=int(out.ok), reason=out.reason, value=out.value,
                                   metrics=out.metrics, duration=result.duration, returncode=result.returncode,
                                   stdout_tail=result.stdout_tail, stderr_tail=result.stderr_tail,
                                   fingerprint=fingerprint() if spec.role == "throughput" else None)
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

    def baseline(self) -> None:
        """The correctness probes once (a failure is a warning) and `repeats` throughput samples of the target as
        the run finds it; BaselineFailed when a sample cannot be taken."""
        for spec in self.correctness:
            out = self.probe(spec, None, "baseline", 0, "baseline")
            if not out.ok:
                self.store.event(self.run.run_id, "warning",
                                 f"baseline fails correctness probe {spec.name}: {out.message}")
        if not self.throughput:
            return
        try:
            samples = [self.sample(None, "baseline", i, "baseline") for i in range(self.run.project.policy.repeats)]
        except ArmFailed as e:
            raise BaselineFailed(f"cannot measure the baseline: {e}") from None
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
        """Pairs until the judge decides; odd pairs measure the candidate first (A B, B A, ...), so a lag within a
        pair (warm caches, a drifting clock) favours each arm equally often, and consecutive pairs share a switch."""
        judge = decide.Judge(policy)
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

    def adopt(self, verdict: Verdict) -> None:
        """A candidate was kept: its samples are now the kept state's."""
        if verdict.cand:
            self.kept_samples = verdict.cand

    def record(self, verdict: Verdict, policy: Policy, vetoes: Sequence[str] = ()) -> None:
        """Store the decision, the policy it was taken under and any guardrail vetoes."""
        self.store.add_decision(self.run.run_id, verdict.step_id, self.objective, verdict.decision.to_dict(),
                                list(vetoes), policy.model_dump())
