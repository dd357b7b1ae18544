"""The ways to pair a candidate's samples with the last kept state's, and the one loop that takes pairs until
the judge decides.

- `Sequential`: one state on disk and one live server at a time. Each pair reverses the order of the one before
  (C B, B C, C B, ...): a lag within a pair favours each arm equally often, and consecutive samples of one arm
  share a server start. Where two servers cannot live side by side.
- `Together`: each arm has a live server of its own, started on its state and alive for the whole block of
  pairs, pinned (it has read its state, so it serves that state whatever is on disk). `coresident`: sampled one
  after the other in the same C B, B C order (one GPU); the kept state's server stays alive from one candidate
  to the next. `sleeping`: as coresident, but only one awake at a time (state_server.py): the one not sampled
  sleeps, so each switch of arm costs a sleep and a wake instead of a server start (vLLM on one GPU, which holds
  most of the card). `simultaneous`: both samples of a pair measured at once from one agreed instant
  (START_AT_ENV), both servers on one core while the probes run on the others (Target.probe_cpus): the OS
  interleaves them every few milliseconds, so a core whose speed drifts by 10-20% within seconds slows both
  alike. The kept state's fresh server starts aside, on a core of its own, and is moved there before its first
  sample (Target.server_cpus). Where the servers are filled once (a GPU), both drivers are asked for a window
  at once.
- `Reused`: `interleave: false`: the kept state's samples reused as the baseline arm, the candidate's taken one
  after the other (Welch's interval).
- `Duet`: a screening worker and its partner (screening.py, policy `duet`), each with both states in a folder of
  its own and a GPU of its own: both samples of a pair at once from one agreed instant, the kept state on one
  worker and the candidate on the other, swapped every pair, so that drift cancels as in `simultaneous` and the
  two cards' difference cancels over the pairs.

Pairs come in blocks of `pairs_per_start` on the same servers; each further block starts fresh servers for both
arms, so that the servers' start effects, which no pair cancels, vary between blocks and the judge counts them
(noise.py); at most `max_starts` blocks a decision. A keep on one pair of servers that the start effects the run
cannot rule out could explain starts a block early, to confirm it (decide.Judge.until_decided).
"""
from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator, Protocol

from orchestrator import decide
from orchestrator.context import RunContext
from orchestrator.noise import Noise, pairs_per_start
from orchestrator.policy import MAX_SAMPLES, Policy
from orchestrator.prober import START_AT_ENV, WARMUP_ENV, Arm, ArmFailed, Prober, Sample, Verdict, failure
from orchestrator.probes.runner import ProbeResult, ProcessResult, confine, kill_group, run_process
from orchestrator.state_server import ServerFailed, StateServer

SIMULTANEOUS_LEAD = 3.0  # seconds from starting a simultaneous pair's probes to their common window
# Fresh simultaneous servers run their first window slower, and not alike (first-use allocations, lazy imports):
# both serve one pair of their own prompts (this pair index plus the judged pairs before it, which no judged
# pair reaches) before their first judged pair, stored as warm-up samples.
WARM_UP_PAIR = MAX_SAMPLES
SERVERS_EVERY = 3  # judged pairs per pair of simultaneous servers when nothing calibrated says otherwise


class Pairing:
    """Pairs until the judge decides. Subclasses say how a block starts and how a pair is taken."""

    mode = "sequential"

    def __init__(self, prober: Prober, policy: Policy, noise: Noise | None = None):
        self.prober = prober
        self.run: RunContext = prober.run
        self.policy = policy
        self.noise = noise

    def per_block(self) -> int:
        """Pairs on one pair of servers before the next block starts fresh ones."""
        if self.policy.pairs_per_start:
            return self.policy.pairs_per_start
        if self.noise is not None:
            return pairs_per_start(self.noise, self.policy.max_pairs)
        return self.policy.max_pairs

    def measure(self, step_id: int | None, name: str, base: Arm, cand: Arm) -> Verdict:
        """The candidate (on disk when called: its correctness probes just ran) against the kept state."""
        per_block = self.per_block()
        base_s: list[Sample] = []
        cand_s: list[Sample] = []

        def take(n: int, fresh: bool):
            if fresh:
                self.new_block(step_id, n, name, base, cand)
            b, c = self.pair(step_id, n, name, base, cand)
            base_s.append(b)
            cand_s.append(c)
            return b.value, c.value, (b.server if b.server is not None else f"b{n}",
                                      c.server if c.server is not None else f"c{n}")

        self.begin(step_id, name, base, cand)
        d = decide.Judge(self.policy, self.noise).until_decided(
            take, per_block, min(self.policy.max_pairs, per_block * self.policy.max_starts))
        return Verdict(step_id, d, base_s, cand_s)

    @contextmanager
    def meanwhile(self, step_id: int | None, name: str, base: Arm, cand: Arm) -> Iterator[None]:
        """Around the candidate's correctness probes (its state on disk before and after)."""
        yield

    def begin(self, step_id: int | None, name: str, base: Arm, cand: Arm) -> None:
        """Before the first pair."""

    def new_block(self, step_id: int | None, n: int, name: str, base: Arm, cand: Arm) -> None:
        """Before pair `n`, the first of a block after the first."""

    def pair(self, step_id: int | None, n: int, name: str, base: Arm, cand: Arm) -> tuple[Sample, Sample]:
        raise NotImplementedError


class Sequential(Pairing):
    """One state on disk at a time; its probes share the disk's live server, restarted when the state changes."""

    def begin(self, step_id, name, base, cand):
        self.on_disk = cand

    def per_block(self) -> int:
        return self.policy.max_pairs  # every change of arm starts a server already

    def pair(self, step_id, n, name, base, cand):
        out: dict[int, Sample] = {}
        for arm, label in (((cand, "candidate"), (base, "baseline")) if n % 2 == 0 else
                           ((base, "baseline"), (cand, "candidate"))):
            if arm is not self.on_disk:
                arm.put_on_disk()
                self.on_disk = arm
            out[id(arm)] = self.prober.sample(step_id, arm, label, n, name)
        return out[id(base)], out[id(cand)]


class Together(Pairing):
    """Both arms on live servers of their own, alive for a whole block; the candidate's is started on its state
    (on disk when called), the kept state's is reused when alive, else started on its state."""

    def __init__(self, prober: Prober, policy: Policy, noise: Noise | None = None, mode: str = "coresident"):
        super().__init__(prober, policy, noise)
        self.mode = mode

    def per_block(self) -> int:
        if not self.policy.pairs_per_start and self.noise is None and self.mode == "simultaneous":
            return SERVERS_EVERY
        return super().per_block()

    def arm_server(self, arm: Arm) -> StateServer:
        if arm.server is None:
            arm.server = StateServer(self.run, pinned=self.mode)
        return arm.server

    def ensure(self, step_id: int | None, n: int, name: str, base: Arm, cand: Arm, fresh: bool) -> None:
        """Both servers up (`fresh`: both restarted), the candidate's first; the candidate's state on disk after.
        Where both arms are the state on disk (an A/A block) both start at once, their first probes waiting for them
        (not where they sleep: one is awake at a time)."""
        if fresh:
            for arm in (cand, base):
                if arm.server is not None:
                    arm.server.stop()
        for arm, label in ((cand, "candidate"), (base, "baseline")):
            server = self.arm_server(arm)
            if server.up:
                continue
            if arm is base:
                base.put_on_disk()
            self.prober.start(arm, label, step_id, n, name, wait=base.show is not None or self.mode == "sleeping",
                              aside=arm is base and not cand.server.aside)
            if arm is base:
                cand.put_on_disk()
        if self.mode == "simultaneous" and (cand.server.unused or base.server.unused):
            # a fresh pair's first windows run slower and apart, filled once too: on an H100 the first window after
            # the fill moved a pair's log ratio by 3.9% (sd), the later ones by 1.7% (BENCHMARKS.md)
            self.pair(step_id, WARM_UP_PAIR + n, name, base, cand, warm_up=True)

    @contextmanager
    def meanwhile(self, step_id, name, base, cand):
        """The kept state's server, due a fresh start, starts while the candidate's correctness probes run on the
        candidate's live server (a start costs seconds on a GPU): the kept state is on disk meanwhile, which the
        probes, all aimed at that server, do not read. The candidate's state is on disk again afterwards. Not where
        servers sleep: there one is awake at a time."""
        starting = self.prestart(step_id, name, base, cand)
        try:
            yield
            if starting:
                try:
                    base.server.wait()  # it has read the kept state
                except ServerFailed:
                    pass  # stopped: `ensure` starts another
        finally:
            if starting:
                cand.put_on_disk()

    def prestart(self, step_id, name, base, cand) -> bool:
        """Start the kept state's fresh server (aside, on the kept state put on disk) where `meanwhile` may:
        whether it is starting. Where it cannot be started here, `ensure` starts it later, and fails as the arm
        it is. Its fill waits for the candidate's, so that both fill and pause alike, as the A/A blocks do: the
        first window after a fresh fill has measured apart from the second (BENCHMARKS.md)."""
        server = cand.server
        aimed = server is not None and server.server is not None and all(
            server.serves(s) for s in self.prober.correctness)
        if (not aimed or not self.prober.throughput or base.show is None or self.mode == "sleeping"
                or (not self.restarts(base) and base.server is not None and base.server.up)):
            return False
        try:
            server.wait()  # it has read the candidate's state
        except ServerFailed:
            return False  # its correctness probe starts another, and fails as the probe it is
        if base.server is not None:
            base.server.stop()
        self.arm_server(base)
        base.put_on_disk()
        try:
            self.prober.start(base, "baseline", step_id, 0, name, wait=False, aside=True)
        except ArmFailed:
            cand.put_on_disk()
            return False
        return True

    def restarts(self, arm: Arm) -> bool:
        """Whether `begin` starts the arm's server afresh: simultaneous arms are both fresh, as the calibration
        measures them; a server that has served only correctness probes is as fresh as a new one, and saves a
        start."""
        server = arm.server
        return self.mode == "simultaneous" and server is not None and not server.unused

    def begin(self, step_id, name, base, cand):
        if self.prober.disk.up:
            self.prober.release()  # whatever served the state on disk before has no part in this
        for arm in (base, cand):
            if self.restarts(arm):
                arm.server.stop()
        self.ensure(step_id, 0, name, base, cand, fresh=False)

    def new_block(self, step_id, n, name, base, cand):
        self.ensure(step_id, n, name, base, cand, fresh=True)

    def pair(self, step_id, n, name, base, cand, warm_up: bool = False):
        arms = {"baseline": base, "candidate": cand}
        for label, arm in arms.items():  # a server gone between pairs cannot be replaced: another serves the disk's
            if crash := arm.server.crashed() or (None if arm.server.up else f"the {label} arm's live server is gone"):
                spec = self.prober.throughput[0]
                raise ArmFailed("crashed", f"{label} arm, probe {spec.name}: {crash}", spec,
                                ProbeResult(False, "crashed", crash, {"error": crash, "reason": "crashed"}))
        if self.mode == "simultaneous":
            samples = self.at_once(step_id, n, name, arms, warm_up)
            return samples["baseline"], samples["candidate"]
        order = ("candidate", "baseline") if n % 2 == 0 else ("baseline", "candidate")
        out = {label: self.prober.sample(step_id, arms[label], label, n, name) for label in order}
        return out["baseline"], out["candidate"]

    def at_once(self, step_id: int | None, n: int, plugin: str, arms: dict[str, Arm],
                warm_up: bool = False) -> dict[str, Sample]:
        """One simultaneous pair: each throughput probe run on both arms' servers at once (on threads; the
        database is written from this one, which records the processes as the threads report them). A warm-up
        pair is stored under the arms `candidate warm-up` and `baseline warm-up` and judged by no one."""
        if all(self.prober.in_turns(arm.server) for arm in arms.values()):
            return self.windows_at_once(step_id, n, plugin, arms, warm_up)
        metrics: dict[str, dict] = {label: {} for label in arms}
        values: dict[str, float | None] = {label: None for label in arms}
        served: dict[str, int | None] = {label: None for label in arms}
        for spec in self.prober.throughput:
            self.run.reporter.phase(plugin, f"probe {spec.name} (both arms #{n + 1})")
            start_at = time.time() + SIMULTANEOUS_LEAD
            jobs = {}
            for label, arm in arms.items():
                env = {**self.prober.env(spec, arm, n, plugin), START_AT_ENV: f"{start_at:.3f}"}
                command = spec.command
                if arm.server.serves(spec):
                    command, env = arm.server.aim(spec, env, step_id, label, plugin)
                    arm.server.measured()
                jobs[label] = (command, env)
            results = self.run_together(jobs, spec, step_id)
            for label, arm in arms.items():
                out = self.prober.judged(spec, results[label], step_id, f"{label} warm-up" if warm_up else label, n,
                                         arm.server)
                if not out.ok:
                    raise ArmFailed(out.reason or "probe_failed", f"{label} arm, probe {spec.name}: {failure(out)}",
                                    spec, out)
                metrics[label].update({k: v for k, v in out.metrics.items() if k not in metrics[label]})
                if values[label] is None:
                    values[label], served[label] = out.value, out.server
        for arm in arms.values():
            arm.server.samples += 1
        return {label: Sample(values[label], metrics[label], served[label]) for label in arms}

    def windows_at_once(self, step_id: int | None, n: int, plugin: str, arms: dict[str, Arm],
                        warm_up: bool = False) -> dict[str, Sample]:
        """One simultaneous pair on servers filled once (orchestrator/turns.py): each server's driver started where
        it has none (both, then their fills awaited: the warm-ups and fills overlap), then both asked for a window
        at once, so that both windows cover the same seconds of the machine."""
        spec = self.prober.throughput[0]
        self.run.reporter.phase(plugin, f"probe {spec.name} (both arms #{n + 1})")
        drivers = {label: self.prober.driver(step_id, arm, label, n, plugin, arm.server,
                                             {WARMUP_ENV: "1"} if arm.server.samples == 0 else {})
                   for label, arm in arms.items()}
        for label, arm in arms.items():
            self.prober.filled(step_id, label, n, arm.server)
        for arm in arms.values():
            arm.server.measured()
        for driver in drivers.values():
            driver.ask()
        results = {label: driver.answer(spec.timeout) for label, driver in drivers.items()}
        return {label: self.prober.turn(step_id, label, n, arms[label].server, results[label],
                                        f"{label} warm-up" if warm_up else None) for label in arms}

    def run_together(self, jobs: dict[str, tuple[list[str], dict[str, str]]], spec,
                     step_id: int | None) -> dict[str, ProcessResult]:
        """Run one probe command per arm at the same time; their process rows are written here as they start
        and end (the store belongs to this thread)."""
        events: queue.Queue = queue.Queue()
        record = self.run.recorder(step_id)
        cpus = self.run.project.target.probe_cpus()

        def launch(arm: str, command: list[str], env: dict[str, str]) -> ProcessResult:
            def on_start(pid: int, create_time: float):
                confine(pid, cpus)
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


class Side:
    """One worker's part of a duet: both states in its folder, one sampled at a time, each on a live server of its
    own where the target's servers can live side by side (`pinned`: the run's pairing), else on the server of the
    state on disk."""

    def __init__(self, prober: Prober, arms: dict[str, Arm], on_disk: str, pinned: str | None):
        self.prober = prober
        self.arms = arms
        self.on_disk = on_disk
        if pinned is not None:
            for arm in arms.values():
                if arm.server is None or arm.server.pinned != pinned:
                    arm.server = StateServer(prober.run, pinned=pinned)

    def sample(self, step_id: int | None, label: str, n: int, name: str, start_at: float) -> Sample:
        arm = self.arms[label]
        if (arm.server is None or not arm.server.up) and self.on_disk != label:
            arm.put_on_disk()  # where its server starts, or the disk's server serves it
            self.on_disk = label
        return self.prober.sample(step_id, arm, label, n, name, {START_AT_ENV: f"{start_at:.3f}"})

    def restart(self) -> None:
        """Fresh servers for the next block: each starts again at its arm's next sample."""
        for arm in self.arms.values():
            if arm.server is not None:
                arm.server.stop()
        self.prober.release()


class Partner(Protocol):
    """The other worker of a duet, as the worker that judges sees it (workers.py)."""

    def ready(self, pinned: str | None) -> None:
        """Once its copy holds both states, each to be served as `pinned` says (Side); EnvironmentFailed where it
        cannot."""

    def sample(self, label: str, n: int, start_at: float) -> Callable[[], Sample]:
        """Start a sample of one arm there; the callable waits for it (ArmFailed: the candidate's failure there,
        EnvironmentFailed: the worker's)."""

    def restart(self) -> None:
        """Its servers stopped: the next block starts fresh ones."""


class Duet(Pairing):
    """Both samples of a pair at once, one on this worker and one on its partner: the kept state here and the
    candidate there at even pairs, the other way round at odd ones."""

    mode = "duet"

    def __init__(self, prober: Prober, policy: Policy, noise: Noise | None, partner: Partner, pinned: str | None):
        super().__init__(prober, policy, noise)
        self.partner = partner
        self.pinned = pinned

    def begin(self, step_id, name, base, cand):
        self.side = Side(self.prober, {"baseline": base, "candidate": cand}, "candidate", self.pinned)
        self.partner.ready(self.pinned)

    def new_block(self, step_id, n, name, base, cand):
        self.side.restart()
        self.partner.restart()

    def pair(self, step_id, n, name, base, cand):
        start_at = time.time() + SIMULTANEOUS_LEAD
        here, there = ("baseline", "candidate") if n % 2 == 0 else ("candidate", "baseline")
        theirs = self.partner.sample(there, n, start_at)
        mine = self.side.sample(step_id, here, n, name, start_at)
        other = theirs()
        return (mine, other) if here == "baseline" else (other, mine)


class Reused(Pairing):
    """`interleave: false`: the kept state's samples (taken once, `repeats` of them) against candidate samples
    added one at a time; the rule `first` takes `repeats` of each."""

    mode = "reused"

    def __init__(self, prober: Prober, policy: Policy, kept_samples: list[Sample] | None):
        super().__init__(prober, policy, None)
        self.kept_samples = kept_samples

    def measure(self, step_id, name, base, cand):
        if self.kept_samples is None:
            base.put_on_disk()
            self.kept_samples = [self.prober.sample(step_id, base, "baseline", i, name)
                                 for i in range(self.policy.repeats)]
            cand.put_on_disk()
        b = [s.value for s in self.kept_samples]
        cand_s: list[Sample] = []
        if self.policy.rule == "first":
            cand_s = [self.prober.sample(step_id, cand, "candidate", i, name) for i in range(self.policy.repeats)]
            return Verdict(step_id, decide.first_rule(b, [s.value for s in cand_s], self.policy.min_gain),
                           self.kept_samples, cand_s)
        judge = decide.Judge(self.policy)
        while True:
            cand_s.append(self.prober.sample(step_id, cand, "candidate", len(cand_s), name))
            d = judge.decide(b, [s.value for s in cand_s], final=len(cand_s) >= self.policy.max_pairs)
            if d is not None:
                return Verdict(step_id, d, self.kept_samples, cand_s)


def choose(prober: Prober, policy: Policy, noise: Noise | None, kept_samples: list[Sample] | None,
           one_at_a_time: bool = False) -> Pairing:
    """The pairing for a comparison on this target: `one_at_a_time` where the candidate changes what sizes a
    server's memory (the side-by-side servers' fixed budgets would hide it), or where no probe talks to a
    server the arms could each have."""
    if not policy.interleave:
        return Reused(prober, policy, kept_samples)
    mode = prober.run.pairing
    if prober.run.partner is not None:
        return Duet(prober, policy, noise, prober.run.partner, None if one_at_a_time or mode == "sequential" else mode)
    if mode == "sequential" or one_at_a_time or not any(prober.serves(s) for s in prober.throughput):
        return Sequential(prober, policy, noise)
    return Together(prober, policy, noise, mode)
