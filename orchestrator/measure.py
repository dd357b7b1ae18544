"""Measuring whatever is on disk: probe runs, one sample of an arm, and samples in A B / B A pairs (or against
reused baseline samples) until the judge decides. The caller switches the images; this module never changes
the target."""
from __future__ import annotations

import os
import queue
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from orchestrator import decide
from orchestrator.config import MAX_SAMPLES, Policy, ProbeSpec
from orchestrator.context import RunContext
from orchestrator.plugin import NUMERICS_ENV, Plugin, numerics_env
from orchestrator.probes.runner import ProbeResult, ProcessResult, judge_output, kill_group, run_process
from orchestrator.state_server import ServerFailed, StateServer
from orchestrator.store import dumps

# A throughput sample's pair index (its `repeat`), for probes: the serving probe offsets its workload's seed by
# it, so both samples of a pair send the same prompts and no two pairs do. A server that serves the last sample
# of one pair and the first of the next (A B, B A) thus never finds the earlier sample's prompts in its prefix
# cache, which would make the later sample faster than its partner on a fresh server.
PAIR_ENV = "ORCHESTRATOR_PAIR"
# Both samples of a simultaneous pair begin their measured window at one instant (seconds since the epoch),
# this long after their probes are started: a probe's start-up (an interpreter, its imports, one test request)
# fits in it.
START_AT_ENV = "ORCHESTRATOR_START_AT"
SIMULTANEOUS_LEAD = 3.0
# Fresh servers run their first window slower, and not alike (first-use allocations, lazy imports): both arms'
# servers serve one pair of their own prompts (this pair index plus the judged pairs before it, which no judged
# pair reaches) before their first judged pair, stored as warm-up samples.
WARM_UP_PAIR = MAX_SAMPLES
SERVERS_EVERY = 3  # judged pairs per pair of servers in a simultaneous comparison (Measurer.start_arms)


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


def _compared(read: dict[str, dict]) -> dict[str, Any]:
    return {name: metrics.get("configuration") for name, metrics in read.items()}


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
        self.configuration = [p for p in probes if p.role == "configuration"]
        self.correctness = [p for p in probes if p.role == "correctness"]
        self.throughput = [p for p in probes if p.role == "throughput"]
        self.objective = self.throughput[0].objective if self.throughput else None
        self.kept_samples: list[Sample] | None = None
        # what each configuration probe read on the last kept state (its `configuration` value), by probe name
        self.kept_configuration: dict[str, dict] | None = None
        self.configurations: dict[int, dict[str, dict]] = {}  # what the probes read on each candidate, by step
        # candidates judged by measurement and rolled back since the last keep: (configuration, plugin, step, reason)
        self.judged_states: list[tuple[dict[str, Any], str, int, str]] = []
        self.plugins = {p.id: p for p in plugins}
        self.holding: dict[str, list[str]] = {"baseline": [], "candidate": []}
        self.server = StateServer(run)
        # both arms at once, each on a server of its own (Target.simultaneous_arms): only where the target's
        # own probes share its live server, since only they can be aimed at one
        self.simultaneous_arms = (any(self.server.serves(s) for s in self.throughput)
                                  and run.project.target.simultaneous_arms())

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
        env.pop(START_AT_ENV, None)
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
        return self.judged(spec, result, step_id, arm, repeat, self.server)

    def judged(self, spec: ProbeSpec, result: ProcessResult, step_id: int | None, arm: str, repeat: int,
               server: StateServer) -> ProbeResult:
        """A finished probe run judged by the probe protocol and stored; a server it talked to that failed is
        stopped (a server that misbehaved is not reused: the next probe starts another)."""
        out = judge_output(spec.role, spec.objective, result, spec.timeout)
        if not out.ok and server.serves(spec):
            if crash := server.crashed():
                out.reason, out.message = "crashed", f"{out.message}; {crash}"
            server.stop()
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

    def configuration_of(self, step_id: int | None, arm: str, plugin: str
                         ) -> tuple[dict[str, dict], tuple[ProbeSpec, ProbeResult] | None]:
        """Each configuration probe's result line on the state on disk, by probe name, with the first failure."""
        read: dict[str, dict] = {}
        for spec in self.configuration:
            out = self.probe(spec, step_id, arm, 0, plugin)
            if not out.ok:
                return read, (spec, out)
            read[spec.name] = out.metrics
        return read, None

    def unchanged(self, step_id: int, plugin: str) -> tuple[dict[str, str] | None, tuple[ProbeSpec, ProbeResult] | None]:
        """Whether the candidate on disk runs what the last kept state runs: `(ignored, None)` when every
        configuration probe reads the same `configuration` value on both (`ignored`: what the probes said the
        target ignores here, and why), `(None, None)` when one differs or there is nothing to compare with,
        `(None, (spec, result))` when a probe failed on the candidate."""
        if not self.configuration or self.kept_configuration is None:
            return None, None
        read, failed = self.configuration_of(step_id, "candidate", plugin)
        self.configurations[step_id] = read
        if failed or _compared(read) != _compared(self.kept_configuration):
            return None, failed
        return {k: str(v) for m in read.values() if isinstance(m.get("ignored"), dict)
                for k, v in m["ignored"].items()}, None

    def judged_like(self, step_id: int) -> tuple[str, int, str] | None:
        """(plugin, step, reason) of a candidate rolled back since the last keep whose configuration probes read
        what they read on this one: the same change, judged against the same kept state. Measuring it again
        would only give the noise a second chance to keep it."""
        read = self.configurations.get(step_id)
        if read:
            for configuration, plugin, earlier, reason in self.judged_states:
                if configuration == _compared(read):
                    return plugin, earlier, reason
        return None

    def remember(self, step_id: int, plugin: str, reason: str) -> None:
        """A candidate was measured and rolled back with `reason` (a verdict of the judge's)."""
        if (read := self.configurations.get(step_id)) and reason in ("no_gain", "regressed", "inconclusive"):
            self.judged_states.append((_compared(read), plugin, step_id, reason))

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
            read, failed = self.configuration_of(None, "baseline", "baseline")
            if failed:
                self.store.event(self.run.run_id, "warning", f"baseline fails configuration probe {failed[0].name}: "
                                 f"{failed[1].message}; every candidate is measured")
            self.kept_configuration = None if failed else read
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
            return self.paired(step_id, policy, name, lambda: show("pre"), lambda: show("post"))
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

    def paired(self, step_id: int | None, policy: Policy, name: str, show_base: Callable[[], None],
               show_cand: Callable[[], None]) -> Verdict:
        """Pairs until the judge decides, the candidate on disk when called: simultaneous where the target allows
        it, else interleaved."""
        mode = self.simultaneous if self.simultaneous_arms else self.interleaved
        return mode(step_id, policy, name, show_base, show_cand)

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

    def simultaneous(self, step_id: int | None, policy: Policy, name: str, show_base: Callable[[], None],
                     show_cand: Callable[[], None]) -> Verdict:
        """Pairs until the judge decides, both samples of a pair measured at the same time: the candidate's
        live server is started on its state (on disk when this is called), the last kept state's on its own,
        and then each pair runs the throughput probes of both arms at once, their windows starting at one
        agreed instant (START_AT_ENV), while the two servers share one core and the probes run on the others
        (Target.simultaneous_arms, probe_cpus). The OS then interleaves the servers every few milliseconds, so
        a core whose speed drifts by 10-20% within seconds slows both alike, where samples taken one after the
        other each catch their own drift (BENCHMARKS.md). Both servers are replaced every SERVERS_EVERY pairs,
        each new pair of them warmed up by a pair of its own, and stopped at the end."""
        self.server.stop()
        servers = {"candidate": StateServer(self.run, simultaneous=True),
                   "baseline": StateServer(self.run, simultaneous=True)}
        judge = decide.Judge(policy)
        base: list[Sample] = []
        cand: list[Sample] = []
        try:
            while True:
                n = len(base)
                if n % SERVERS_EVERY == 0:
                    self.start_arms(step_id, n, name, servers, show_base, show_cand)
                samples = self.pair(step_id, n, name, servers)
                cand.append(samples["candidate"])
                base.append(samples["baseline"])
                d = judge.decide([s.value for s in base], [s.value for s in cand], final=n + 1 >= policy.max_pairs)
                if d is not None:
                    return Verdict(step_id, d, base, cand)
        finally:
            for server in servers.values():
                server.stop()

    def start_arms(self, step_id: int | None, n: int, name: str, servers: dict[str, StateServer],
                   show_base: Callable[[], None], show_cand: Callable[[], None]) -> None:
        """Fresh servers for both arms (the candidate's first, on its state on disk; then the last kept state's),
        and their warm-up pair. Two processes of one config can differ by a percent or more for their whole life
        (where the OS put their memory, say; an A/A test, BENCHMARKS.md), so the servers are replaced every
        SERVERS_EVERY pairs, and that difference varies between the pairs instead of biasing them all."""
        for server in servers.values():
            server.stop()
        for arm, show in (("candidate", None), ("baseline", show_base)):
            if show is not None:
                show()
            spec = next(s for s in self.throughput if servers[arm].serves(s))
            started = time.monotonic()
            try:
                servers[arm].aim(spec, self.env(spec, arm, n, name), step_id, arm, name)
            except ServerFailed as e:
                out = self.server_failed(spec, e, step_id, arm, n, time.monotonic() - started)
                raise ArmFailed(out.reason or "probe_failed", f"{arm} arm, probe {spec.name}: {failure(out)}",
                                spec, out) from None
        show_cand()
        self.pair(step_id, WARM_UP_PAIR + n, name, servers, warm_up=True)

    def pair(self, step_id: int | None, n: int, plugin: str, servers: dict[str, StateServer],
             warm_up: bool = False) -> dict[str, Sample]:
        """One simultaneous pair: each throughput probe run on both arms' servers at once (on threads; the
        database is written from this one, which records the processes as the threads report them). A warm-up
        pair is stored under the arms `candidate warm-up` and `baseline warm-up` and judged by no one."""
        metrics: dict[str, dict[str, Any]] = {arm: {} for arm in servers}
        values: dict[str, float | None] = {arm: None for arm in servers}
        for spec in self.throughput:
            self.run.reporter.phase(plugin, f"probe {spec.name} (both arms #{n + 1})")
            start_at = time.time() + SIMULTANEOUS_LEAD
            jobs = {}
            for arm, server in servers.items():
                env = {**self.env(spec, arm, n, plugin), START_AT_ENV: f"{start_at:.3f}"}
                command = spec.command
                if server.serves(spec):
                    # another start would serve whatever state is on disk, not this arm's
                    if crash := server.crashed() or (None if server.server else f"the {arm} arm's live server is gone"):
                        out = ProbeResult(False, "crashed", crash, {"error": crash, "reason": "crashed"})
                        raise ArmFailed("crashed", f"{arm} arm, probe {spec.name}: {crash}", spec, out)
                    command = server.aim(spec, env, step_id, arm, plugin).command
                jobs[arm] = (command, env)
            results = self.run_together(jobs, spec, step_id)
            for arm, result in results.items():
                out = self.judged(spec, result, step_id, f"{arm} warm-up" if warm_up else arm, n, servers[arm])
                if not out.ok:
                    raise ArmFailed(out.reason or "probe_failed", f"{arm} arm, probe {spec.name}: {failure(out)}",
                                    spec, out)
                metrics[arm].update({k: v for k, v in out.metrics.items() if k not in metrics[arm]})
                if values[arm] is None:
                    values[arm] = out.value
        return {arm: Sample(values[arm], metrics[arm]) for arm in servers}

    def run_together(self, jobs: dict[str, tuple[list[str], dict[str, str]]], spec: ProbeSpec,
                     step_id: int | None) -> dict[str, ProcessResult]:
        """Run one probe command per arm at the same time; their process rows are written here as they start
        and end (the store belongs to this thread), and the run's heartbeat goes on meanwhile."""
        events: queue.Queue = queue.Queue()
        record = self.run.recorder(step_id)
        cpus = self.run.project.target.probe_cpus()

        def launch(arm: str, command: list[str], env: dict[str, str]) -> ProcessResult:
            def on_start(pid: int, create_time: float):
                if cpus:
                    try:  # just started: one thread, whose later ones inherit this
                        os.sched_setaffinity(pid, cpus)
                    except OSError:
                        pass
                events.put(("start", arm, pid, create_time))
                return lambda: events.put(("end", arm, None, None))
            return run_process(command, self.run.project.base_dir, env, spec.timeout, on_start=on_start,
                               tmp_dir=self.run.tmp)

        ends: dict[str, Callable[[], None]] = {}

        def drain(pids: list[int]) -> None:
            while True:
                try:
                    kind, arm, pid, create_time = events.get_nowait()
                except queue.Empty:
                    return
                if kind == "start":
                    pids.append(pid)
                    ends[arm] = record(f"probe {spec.name} ({arm})", pid, create_time)
                elif arm in ends:
                    ends.pop(arm)()

        started = time.monotonic()
        pids: list[int] = []
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            futures = {arm: pool.submit(launch, arm, *job) for arm, job in jobs.items()}
            try:
                while not all(f.done() for f in futures.values()):
                    drain(pids)
                    self.run.tick(time.monotonic() - started, "")
                    time.sleep(0.05)
            except BaseException:  # SIGTERM, Ctrl-C: end the probes now, not at their timeout
                drain(pids)
                for pid in pids:
                    kill_group(pid, pid)
                raise
        drain(pids)
        return {arm: f.result() for arm, f in futures.items()}

    def adopt(self, verdict: Verdict) -> None:
        """A candidate was kept: its samples and configuration are now the kept state's."""
        if verdict.cand:
            self.kept_samples = verdict.cand
        if self.kept_configuration is not None:
            self.kept_configuration = self.configurations.get(verdict.step_id)
        self.judged_states = []

    def record(self, verdict: Verdict, policy: Policy, vetoes: Sequence[str] = ()) -> None:
        """Store the decision, the policy it was taken under and any guardrail vetoes."""
        self.store.add_decision(self.run.run_id, verdict.step_id, self.objective, verdict.decision.to_dict(),
                                list(vetoes), policy.model_dump())
