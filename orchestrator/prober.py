"""Running the project's probes on one arm's state and storing what each one read: the only writer of
measurements. A probe that talks to a server is aimed at that arm's live server (its own, pinned, when the arm has
one; else the server of the state on disk, started on demand); any other runs with no server of the state on disk
alive. The caller puts states on disk; this module never changes the target."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from orchestrator.config import ProbeSpec
from orchestrator.context import RunContext
from orchestrator.plugin import NUMERICS_ENV, Plugin, numerics_env
from orchestrator.probes.runner import ProbeResult, ProcessResult, confine, judge_output, run_process
# the serving probe's protocol (its pair index, a simultaneous pair's start, a fresh server's warm-up), owned there
from orchestrator.probes.serving import PAIR_ENV, START_AT_ENV, WARMUP_ENV
from orchestrator.state_server import ServerFailed, StateServer, hush
from orchestrator.store import dumps
from orchestrator.turns import Turns

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
    server: int | None = None  # the live server that served it (its processes row), or None
    segment: int = 0  # the times that server had been woken before it (a sleeping pairing's servers)
    at: float = 0.0  # when it ended (seconds since the epoch)
    fresh: bool = False  # the first sample of a server just started (taken after a warm-up: WARMUP_ENV)


@dataclass(eq=False)
class Arm:
    """One side of a comparison: a state (the plugins it holds), how to put it on disk, and its own live server
    where the pairing gives it one (pinned: it lives beside the other arm's, whatever is on disk). What a sample
    of it is labelled (baseline, candidate, control) is the caller's to say: the kept state is the candidate
    arm of a final re-validation."""
    holding: list[str]
    show: Callable[[], None] | None = None  # puts this arm's state on disk (None: it is on disk already)
    server: StateServer | None = None

    def put_on_disk(self) -> None:
        if self.show is not None:
            self.show()


@dataclass
class Verdict:
    step_id: int | None
    decision: Any  # decide.Decision, or None when nothing was measured
    base: list[Sample] = field(default_factory=list)
    cand: list[Sample] = field(default_factory=list)

    def server_pairs(self) -> tuple[list[float], list[tuple[int, int]]]:
        """The log ratios log(candidate / baseline) of the pairs whose two servers are known, and those servers."""
        logs, servers = [], []
        for b, c in zip(self.base, self.cand):
            if b.server is not None and c.server is not None and b.value and c.value and b.value > 0 < c.value:
                logs.append(math.log(c.value / b.value))
                servers.append((b.server, c.server))
        return logs, servers


def medians(samples: Sequence[dict[str, Any]]) -> dict[str, float]:
    keys = set.intersection(*(set(s) for s in samples)) if samples else set()
    return {k: statistics.median(s[k] for s in samples) for k in sorted(keys)
            if all(isinstance(s[k], (int, float)) and not isinstance(s[k], bool) for s in samples)}


def failure(out: ProbeResult) -> str:
    """The probe's verdict and the last lines it wrote, for the step's detail."""
    proc = out.process
    lines = [ln.strip() for ln in ((proc.stderr_tail or proc.stdout_tail) if proc else "").splitlines() if ln.strip()]
    return out.message + (f" (output: {' | '.join(lines[-2:])[-300:]})" if lines else "")


def fingerprint() -> dict | None:
    try:
        from orchestrator.fingerprint import environment
        return environment()
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 - a broken fingerprint must not stop a measurement
        return {"error": repr(e)}


class Prober:
    """The project's probes for one run. `disk` is the live server of the state on disk, shared by the probes of
    an arm that has no server of its own; `release` stops it."""

    def __init__(self, run: RunContext, plugins: Iterable[Plugin] = ()):
        self.run = run
        self.store = run.store
        probes = run.project.probes
        self.configuration = [p for p in probes if p.role == "configuration"]
        self.correctness = [p for p in probes if p.role == "correctness"]
        self.throughput = [p for p in probes if p.role == "throughput"]
        self.objective = self.throughput[0].objective if self.throughput else None
        self.plugins = {p.id: p for p in plugins}
        self.disk = StateServer(run)

    def release(self) -> None:
        """Stop the live server of the state on disk, if one is up."""
        self.disk.stop()

    def serves(self, spec: ProbeSpec) -> bool:
        return self.disk.serves(spec)

    @property
    def reads_server(self) -> bool:
        """Whether a configuration probe reads the state's live server (vLLM's resolved config)."""
        return any(self.serves(s) for s in self.configuration)

    def before_configuration(self) -> list[ProbeSpec]:
        """The correctness probes that run before the configuration probes: where those read the state's server,
        the ones that need no server (they put every server to sleep, and the server read is the one measured)."""
        return [s for s in self.correctness if not self.serves(s)] if self.reads_server else []

    def env(self, spec: ProbeSpec, arm: Arm, repeat: int, plugin: str) -> dict[str, str]:
        """The probe environment of the arm's state: its plugins that change numerics (NUMERICS_ENV), and for a
        throughput probe the pair index."""
        env = self.run.env(plugin)
        for name in (NUMERICS_ENV, PAIR_ENV, START_AT_ENV, WARMUP_ENV):
            env.pop(name, None)
        env.update(numerics_env([self.plugins[i] for i in arm.holding if i in self.plugins]))
        if spec.role == "throughput":
            env[PAIR_ENV] = str(repeat)
        return env

    def server_of(self, arm: Arm) -> StateServer:
        return arm.server if arm.server is not None else self.disk

    def start(self, arm: Arm, label: str, step_id: int | None, repeat: int, plugin: str, wait: bool = True,
              aside: bool = False) -> None:
        """Start the arm's own server on its state, which is on disk; ArmFailed when it does not come up (without
        `wait`, only when it cannot be started: the first probe aimed at it waits for its health). `aside`: see
        StateServer.start."""
        spec = next((s for s in [*self.throughput, *self.correctness] if arm.server.serves(s)), None)
        if spec is None:
            return
        started = time.monotonic()
        try:
            arm.server.start(self.env(spec, arm, repeat, plugin), step_id, label, plugin, wait=wait, aside=aside)
        except ServerFailed as e:
            out = self.server_failed(spec, e, step_id, label, repeat, time.monotonic() - started)
            raise ArmFailed(out.reason or "probe_failed", f"{label} arm, probe {spec.name}: {failure(out)}",
                            spec, out) from None

    def probe(self, spec: ProbeSpec, step_id: int | None, arm: Arm, label: str, repeat: int, plugin: str,
              extra_env: dict[str, str] | None = None) -> ProbeResult:
        """Run one probe on the arm's state and store its measurement under `label`."""
        self.run.reporter.phase(plugin, f"probe {spec.name} ({label} #{repeat + 1})")
        env = {**self.env(spec, arm, repeat, plugin), **(extra_env or {})}
        command = spec.command
        server = self.server_of(arm)
        if server.serves(spec):
            started = time.monotonic()
            try:
                command, env = server.aim(spec, env, step_id, label, plugin)
            except ServerFailed as e:
                return self.server_failed(spec, e, step_id, label, repeat, time.monotonic() - started)
            self.run.reporter.phase(plugin, f"probe {spec.name} ({label} #{repeat + 1})")
        else:
            self.disk.stop()  # the probe may need the device to itself
            hush(self.run, step_id)
        on_start = self.run.recorder(step_id)
        result = run_process(command, self.run.project.base_dir, env, spec.timeout,
                             on_start=lambda pid, ct: on_start(f"probe {spec.name}", pid, ct),
                             on_tick=self.run.tick, tmp_dir=self.run.tmp)
        return self.judged(spec, result, step_id, label, repeat, server)

    def judged(self, spec: ProbeSpec, result: ProcessResult, step_id: int | None, label: str, repeat: int,
               server: StateServer) -> ProbeResult:
        """A finished probe run judged by the probe protocol and stored; a server it talked to that failed is
        stopped (a server that misbehaved is not reused: the next probe starts another)."""
        out = judge_output(spec.role, spec.objective, result, spec.timeout)
        served = server.start_id if server.serves(spec) and server.up else None
        if out.ok and spec.role == "correctness" and served is not None:
            server.unchecked.discard(spec.name)
        if not out.ok and server.serves(spec):
            if crash := server.crashed():
                out.reason, out.message = "crashed", f"{out.message}; {crash}"
            server.stop()
        self.store.add_measurement(run_id=self.run.run_id, step_id=step_id, probe=spec.name, role=spec.role,
                                   arm=label, repeat=repeat, ok=int(out.ok), reason=out.reason, value=out.value,
                                   metrics=out.metrics, duration=result.duration, returncode=result.returncode,
                                   stdout_tail=result.stdout_tail, stderr_tail=result.stderr_tail,
                                   fingerprint=fingerprint() if spec.role == "throughput" else None, server=served)
        out.server = served
        return out

    def server_failed(self, spec: ProbeSpec, e: ServerFailed, step_id: int | None, label: str, repeat: int,
                      waited: float) -> ProbeResult:
        """The live server a probe needed did not start: that probe's failure, `crashed` or `timeout`, stored with
        the server log's tail as its output and the time spent waiting for it as its duration."""
        message = f"the live server did not start: {e.summary}"
        tail = e.tail[-4000:]
        out = ProbeResult(False, e.reason, message, {"error": message, "reason": e.reason},
                          process=ProcessResult(None, e.reason == "timeout", waited, tail, ""))
        self.store.add_measurement(run_id=self.run.run_id, step_id=step_id, probe=spec.name, role=spec.role, arm=label,
                                   repeat=repeat, ok=0, reason=out.reason, value=None, metrics=out.metrics,
                                   duration=waited, returncode=None, stdout_tail=tail, stderr_tail="",
                                   fingerprint=None)
        return out

    def sample(self, step_id: int | None, arm: Arm, label: str, repeat: int, plugin: str,
               extra_env: dict[str, str] | None = None) -> Sample:
        """One measurement of the arm's state: every throughput probe once, metrics merged. The first sample on
        a fresh live server warms it up first (WARMUP_ENV)."""
        metrics: dict[str, Any] = {}
        value, served = None, None
        server = self.server_of(arm)
        if server.up:
            self.woken(step_id, arm, label, repeat, plugin, server)
        fresh = {WARMUP_ENV: "1"} if not server.up or server.samples == 0 else {}
        if self.in_turns(server):
            self.run.reporter.phase(plugin, f"probe {self.throughput[0].name} ({label} #{repeat + 1})")
            turns = self.driver(step_id, arm, label, repeat, plugin, server, {**fresh, **(extra_env or {})})
            self.filled(step_id, label, repeat, server)
            return self.turn(step_id, label, repeat, server, turns.window(self.throughput[0].timeout))
        for spec in self.throughput:
            out = self.probe(spec, step_id, arm, label, repeat, plugin, {**fresh, **(extra_env or {})})
            if not out.ok:
                raise ArmFailed(out.reason or "probe_failed", f"{label} arm, probe {spec.name}: {failure(out)}",
                                spec, out)
            metrics.update({k: v for k, v in out.metrics.items() if k not in metrics})
            if value is None:
                value, served = out.value, out.server
        if server.up:
            server.samples += 1
        return Sample(value, metrics, served, server.wakes, time.time(), bool(fresh))

    def in_turns(self, server: StateServer) -> bool:
        """Whether the server's samples are windows of one fill (orchestrator/turns.py): it fills once, and its
        one throughput probe is the target's own serving probe."""
        return server.fills_once and len(self.throughput) == 1 and self.throughput[0].name in server.shared

    def driver(self, step_id: int | None, arm: Arm, label: str, repeat: int, plugin: str, server: StateServer,
               extra_env: dict[str, str]) -> Turns:
        """The serving driver of the arm's server, started (and the server with it where none is up) at the
        server's first sample; `filled` waits for its fill."""
        spec = self.throughput[0]
        if server.turns is not None and not server.up:
            server.end_turns()
        if server.turns is None:
            env = {**self.env(spec, arm, 0, plugin), **extra_env}  # one stream of prompts for the server's life
            started = time.monotonic()
            try:
                command, env = server.aim(spec, env, step_id, label, plugin)
            except ServerFailed as e:
                out = self.server_failed(spec, e, step_id, label, repeat, time.monotonic() - started)
                raise ArmFailed(out.reason or "probe_failed", f"{label} arm, probe {spec.name}: {failure(out)}",
                                spec, out) from None
            record = self.run.recorder(step_id)
            # a simultaneous server's core is the two servers' alone: its driver runs on the others
            cpus = self.run.project.target.probe_cpus() if server.pinned == "simultaneous" else None

            def on_start(pid: int, create_time: float):
                confine(pid, cpus)
                return record(f"probe {spec.name} (turns)", pid, create_time)
            server.turns = Turns([*command, "--turns"], self.run.project.base_dir, env, spec.timeout,
                                 on_start=on_start, on_tick=self.run.tick, tmp_dir=self.run.tmp)
        return server.turns

    def filled(self, step_id: int | None, label: str, repeat: int, server: StateServer) -> None:
        """Wait for the fill of the server's driver; ArmFailed (the driver dropped) where it could not fill."""
        spec = self.throughput[0]
        if (failed := server.turns.filled()) is not None:
            server.turns = None
            out = self.judged(spec, failed, step_id, label, repeat, server)
            raise ArmFailed(out.reason or "probe_failed", f"{label} arm, probe {spec.name} (its fill): "
                            f"{failure(out)}", spec, out)

    def turn(self, step_id: int | None, label: str, repeat: int, server: StateServer, result: ProcessResult,
             stored_as: str | None = None) -> Sample:
        """A window of the server's driver, stored as the probe's measurement (under the arm `stored_as`, default
        `label`); ArmFailed where it failed."""
        spec = self.throughput[0]
        if result.returncode != 0:
            server.turns = None  # stopped by its failure
        out = self.judged(spec, result, step_id, stored_as or label, repeat, server)
        if not out.ok:
            raise ArmFailed(out.reason or "probe_failed", f"{label} arm, probe {spec.name}: {failure(out)}", spec, out)
        server.samples += 1
        return Sample(out.value, out.metrics, out.server, server.wakes, time.time(), server.samples == 1)

    def woken(self, step_id: int | None, arm: Arm, label: str, repeat: int, plugin: str, server: StateServer) -> None:
        """The arm's live server awake (every other asleep, where the run pairs by sleeping), and the correctness
        probes it owes passed (once after its start, once after its first wake); ArmFailed otherwise."""
        spec = self.throughput[0]
        started = time.monotonic()
        try:
            server.rouse(step_id)
        except ServerFailed as e:
            out = self.server_failed(spec, e, step_id, label, repeat, time.monotonic() - started)
            raise ArmFailed(out.reason or "crashed", f"{label} arm, probe {spec.name}: {failure(out)}", spec,
                            out) from None
        for check in self.correctness:
            if check.name in server.unchecked:
                out = self.probe(check, step_id, arm, label, repeat, plugin)
                if not out.ok:
                    raise ArmFailed(out.reason or "incorrect", f"{label} arm, probe {check.name} on its server "
                                    f"(after its start or its first wake): {failure(out)}", check, out)

    def configuration_of(self, step_id: int | None, arm: Arm, label: str, plugin: str
                         ) -> tuple[dict[str, dict], tuple[ProbeSpec, ProbeResult] | None]:
        """Each configuration probe's result line on the arm's state, by probe name, with the first failure."""
        read: dict[str, dict] = {}
        for spec in self.configuration:
            out = self.probe(spec, step_id, arm, label, 0, plugin)
            if not out.ok:
                return read, (spec, out)
            read[spec.name] = out.metrics
        return read, None

    def failed_correctness(self, step_id: int | None, arm: Arm, label: str, plugin: str,
                           specs: Sequence[ProbeSpec] | None = None) -> tuple[ProbeSpec, ProbeResult] | None:
        """The first correctness probe (of ``specs``, by default all) that fails on the arm's state, with its
        result; None when all pass."""
        for spec in self.correctness if specs is None else specs:
            out = self.probe(spec, step_id, arm, label, 0, plugin)
            if not out.ok:
                return spec, out
        return None

    def record(self, verdict: Verdict, policy, vetoes: Sequence[str] = ()) -> None:
        """Store the decision, the policy it was taken under and any guardrail vetoes."""
        self.store.add_decision(self.run.run_id, verdict.step_id, self.objective, verdict.decision.to_dict(),
                                list(vetoes), policy.judging())


def numbers(v: Verdict) -> dict[str, Any]:
    """The step's columns for a verdict: gain, objective before and after, metric medians of each arm."""
    d = v.decision
    return dict(gain=d.gain if d else None,
                before_value=d.baseline_median if d else None, after_value=d.candidate_median if d else None,
                metrics=dumps(medians([s.metrics for s in v.cand])) if v.cand else None,
                baseline_metrics=dumps(medians([s.metrics for s in v.base])) if v.base else None)
