"""A live server of one state, shared by the probes that judge that state.

A vLLM start costs a minute or more and an engine start on a GPU about ten seconds, while a serving
sample lasts seconds: when every probe started its own server, server starts were most of a staged
run. So where the target offers one (``Target.live_server``), the staging loop starts one server when
the first probe that talks to a server runs on a state (the target's own ``Target.probes_against``, or a
user's probe that says ``server: true``), aims that probe and every later one of the same state at it
(``--base-url``, ``--server-pid``; a user's probe gets ``ORCHESTRATOR_BASE_URL`` and
``ORCHESTRATOR_SERVER_PID``), and stops it:

- a server of the state on disk (``pinned=False``): before that state changes (the journal's watcher:
  images shown or restored, pre-images recorded before an apply step writes), so a server never outlives
  the state it serves; and before a probe that does not talk to it, which may need the device to itself;
- a pinned server (one arm of a comparison whose servers live side by side, pairing.py): it has read its
  state at start, so it lives on however the disk changes, until its owner stops it;
- either: after a probe that talked to it failed (a server that misbehaved is not reused), and however a
  run ends.

Where the run pairs by sleeping (a vLLM with sleep mode, one GPU), every server of the run joins the run's
`sleepers` and at most one of them is awake at any instant: before one is started or a probe is aimed at it, every
other is put to sleep (its weights moved to the host's memory, its KV cache dropped; a server that cannot sleep is
stopped), and a sleeping one is woken. So the kept state's server lives from candidate to candidate, asleep while
the candidate's is started, checked and sampled, and a candidate's sleeps while the kept one is sampled; a probe
that talks to no server runs with all of them asleep. A server's serving correctness probes (the greedy outputs)
are due once after its start and once after its first wake (`unchecked`): a woken server must still answer as it
did.

Stopping returns only once its process group exited and released its GPU memory (``LiveServer.stop``).
The server runs in its own process group, its row in the processes table is written as soon as it
started (its `ready` time once healthy), and it carries a process mark of the run, so `recover` kills it
after the orchestrator died. `start_id`, that row's id, names the server's life: the judge counts the
start effects of the servers behind its pairs by it.
"""
from __future__ import annotations

import time
from typing import Callable

import httpx
import psutil

from orchestrator.config import ProbeSpec
from orchestrator.context import RunContext
from orchestrator.probes.live_server import LiveServer, ServerFailed, log_name
from orchestrator.probes.marks import marked_env, new_mark, sweep_mark
from orchestrator.probes.runner import move
from orchestrator.turns import Turns

BASE_URL_ENV = "ORCHESTRATOR_BASE_URL"  # a user's probe with `server: true`: the live server to talk to
SERVER_PID_ENV = "ORCHESTRATOR_SERVER_PID"


class StateServer:
    """At most one live server of one state; started on demand by `aim` (or `start`)."""

    def __init__(self, run: RunContext, pinned: str | None = None):
        self.run = run
        # how a pinned server lives beside another state's (Target.pairing): "coresident", "sleeping" or
        # "simultaneous"
        self.pinned = pinned
        self.target = run.project.target
        # the target's own probes that talk to its server; a user's probe says so itself (ProbeSpec.server)
        own = run.project.config.probes is None
        self.shared = {s["name"] for s in self.target.probes_against("http://127.0.0.1:0")} if own else set()
        self.server: LiveServer | None = None
        self.what = ""
        self.start_id: int | None = None
        self.samples = 0  # throughput samples it has served: the first of a fresh server warms it up
        self.asleep = False
        self.wakes = 0  # times woken in this life: a sample's `segment` of it
        self.switches: list[tuple[int | None, str, float]] = []  # (step, "sleep" | "wake", seconds) of every life
        self.unchecked: set[str] = set()  # serving correctness probes due on it (sleeping pairing, above)
        self.turns: Turns | None = None  # its serving driver, where it is filled once (orchestrator/turns.py)
        self.aside = False  # started on CPUs of its own, not yet moved for its samples (`measured`)
        self.arm: str | None = None  # the side it serves: "baseline" or "candidate"
        self._healthy = False
        self._step_id: int | None = None
        self._mark = ""
        self._since = 0.0
        self._end: Callable[[], None] | None = None
        if pinned is None:
            run.journal.watch(self.stop)
        if run.pairing == "sleeping":
            run.sleepers.append(self)

    @property
    def sleeps(self) -> bool:
        """Whether it can sleep rather than stop when another server of the run is used."""
        return self.pinned == "sleeping" and self.target.sleep_paths() is not None

    def serves(self, spec: ProbeSpec) -> bool:
        """Whether `spec` talks to the live server (else it runs with none alive)."""
        return spec.name in self.shared or (spec.server and self.target.has_server())

    @property
    def up(self) -> bool:
        return self.server is not None and self.server.exited() is None

    def aim(self, spec: ProbeSpec, env: dict[str, str], step_id: int | None, arm: str,
            label: str) -> tuple[list[str], dict[str, str]]:
        """`spec`'s command and environment aimed at this live server, started first when none is up (with
        `env`, the probe environment of its state, which must then be on disk). ServerFailed ("crashed" or
        "timeout", with its log's tail) when it cannot be started or does not become healthy; it is stopped
        then."""
        self.end_turns()  # anything else that talks to it finds it running, not paused mid-stream
        if self.server is not None and (code := self.server.exited()) is not None:
            self.run.store.event(self.run.run_id, "warning", f"the {self.what} of {label} exited with code {code} "
                                                             "between two probes; another is started", step_id)
            self.stop()
        if self.server is None:
            self.start(env, step_id, arm, label)
        self.wait()
        self.rouse(step_id)
        if spec.name in self.shared:
            aimed = {s["name"]: s for s in self.target.probes_against(self.server.url, self.server.pid)}
            return list(aimed[spec.name]["command"]), env
        return list(spec.command), {**env, BASE_URL_ENV: self.server.url, SERVER_PID_ENV: str(self.server.pid)}

    def start(self, env: dict[str, str], step_id: int | None, arm: str, label: str, wait: bool = True,
              aside: bool = False) -> None:
        """Start a server of the state on disk; with `wait`, return once it is healthy (else the first `aim` or
        `wait` waits: a pinned server can come up while something else runs, the configuration probe say).
        `aside`: on the target's CPUs for a server not yet measured, until `measured` moves it."""
        hush(self.run, step_id, but=self)
        self.what, self._step_id = f"live server ({arm})", step_id
        self._mark, self._since = new_mark(), time.time() - 5  # start times are rounded to the boot time's second
        server = self.target.live_server(marked_env(env, self._mark),
                                         label=log_name(f"run{self.run.run_id}", label, arm), beside=self.pinned,
                                         aside=aside, arm=arm)
        self.aside, self.arm = aside, arm
        self.run.reporter.phase(label, f"starting the {self.what}")
        server.start()  # ServerFailed("crashed") when the command cannot be started: nothing runs then
        self.server = server
        self.samples = self.wakes = 0
        self.asleep = False
        self.unchecked = self.checks() if self.sleeps else set()
        try:
            create_time = psutil.Process(server.pid).create_time()
        except psutil.Error:
            create_time = time.time()
        self._end = self.run.recorder(step_id)(self.what, server.pid, create_time)
        self.start_id = self._end.id
        self._healthy = False
        if wait:
            self.wait()

    def wait(self) -> None:
        """Until the started server answers its health check (at most the target's start-up timeout);
        ServerFailed, the server stopped, when it does not."""
        if self.server is None or self._healthy:
            return
        try:
            self.server.wait_healthy(self.target.startup_timeout, on_tick=self.run.tick)
        except BaseException:
            self.stop()
            raise
        self._healthy = True
        self.run.store.process_ready(self.start_id)

    def measured(self) -> None:
        """Before its samples: a server started aside moved onto the CPUs where servers beside each other are
        measured (Target.server_cpus), once it is healthy (it has pinned itself by then)."""
        if not self.aside or self.server is None:
            return
        self.wait()
        if cpus := self.target.server_cpus(self.pinned, measured=True, arm=self.arm):
            move(self.server.pid, cpus)
        self.aside = False

    def checks(self) -> set[str]:
        """The correctness probes that talk to this server."""
        return {s.name for s in self.run.project.probes if s.role == "correctness" and self.serves(s)}

    def rouse(self, step_id: int | None) -> None:
        """Before this server is used: every other server of the run asleep, and this one awake."""
        hush(self.run, step_id, but=self)
        if self.asleep:
            self.switch(step_id, "wake")
            self.asleep = False
            self.wakes += 1
            if self.wakes == 1:
                self.unchecked = self.checks()

    def sleep(self, step_id: int | None) -> None:
        """Put it to sleep; one that cannot sleep (or sleep in this pairing) is stopped instead."""
        if not self.up or self.asleep:
            return
        if not self.sleeps:
            return self.stop()
        try:
            self.switch(step_id, "sleep")
        except ServerFailed as e:
            self.run.store.event(self.run.run_id, "warning", f"{e.summary}; it is stopped instead", step_id)
            return self.stop()
        self.asleep = True

    def switch(self, step_id: int | None, way: str) -> None:
        """POST the target's sleep or wake path and wait for its answer (recorded as an event with its seconds);
        ServerFailed("crashed"), the server stopped, when it does not answer so."""
        path = self.target.sleep_paths()[0 if way == "sleep" else 1]
        started = time.monotonic()
        try:
            answer = httpx.post(self.server.url + path, timeout=self.target.startup_timeout)
            ok = answer.status_code == 200 and (way == "sleep" or answer.json().get("status", "awake") == "awake")
            why = f"HTTP {answer.status_code}: {answer.text[:300]}"
        except (httpx.HTTPError, ValueError) as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        seconds = time.monotonic() - started
        if not ok:
            self.stop()
            raise ServerFailed("crashed", f"the {self.what} did not {way} ({path}: {why})")
        self.switches.append((step_id, way, seconds))
        self.run.store.event(self.run.run_id, f"server_{'slept' if way == 'sleep' else 'woken'}",
                             f"the {self.what} (process row {self.start_id}) {'slept' if way == 'sleep' else 'woke'} "
                             f"in {seconds:.2f} s", step_id)

    def crashed(self) -> str | None:
        """When the live server has exited: its exit code and the last lines of its log, for a probe's failure."""
        if self.server is None or (code := self.server.exited()) is None:
            return None
        lines = [ln.strip() for ln in self.server.tail().splitlines() if ln.strip()]
        return f"the {self.what} exited with code {code}" + (f" (log: {' | '.join(lines[-2:])[-300:]})"
                                                            if lines else "")

    @property
    def unused(self) -> bool:
        """Never sampled in this life (correctness probes do not count): its first windows run slower and apart."""
        return self.samples == 0 and self.turns is None

    @property
    def fills_once(self) -> bool:
        """Whether its samples are windows of one fill (orchestrator/turns.py): a pinned server (one of two side by
        side) of a target that fills once."""
        return self.pinned is not None and self.target.fills_once()

    def end_turns(self) -> None:
        """Stop its serving driver, if any (the server resumed)."""
        turns, self.turns = self.turns, None
        if turns is not None:
            turns.stop()

    def stop(self) -> None:
        """Stop the live server, if any: SIGTERM, SIGKILL of its group after the grace period, then whatever
        escaped the group (by its mark); returns once all are gone and the GPU memory is released."""
        self.end_turns()
        server, self.server = self.server, None
        self.aside = False
        if server is None:
            return
        self.asleep = False
        try:
            server.stop()
        finally:
            sweep_mark(self._mark, self._since)
            if not server.leftover and self._end is not None:  # one that outlived SIGKILL stays for recover
                self._end()
            self._end = None
            if server.stopped_by == "SIGKILL" or server.leftover:
                left = f"; processes {server.leftover} outlived SIGKILL" if server.leftover else ""
                self.run.store.event(self.run.run_id, "server_killed",
                                     f"the {self.what} (pid {server.pid}) did not exit within "
                                     f"{server.stop_timeout:g} s of SIGTERM: its process group was killed{left}",
                                     self._step_id)


def hush(run: RunContext, step_id: int | None, but: StateServer | None = None) -> None:
    """Every server of a run that pairs by sleeping asleep (or stopped, where it cannot sleep), but `but`."""
    for server in run.sleepers:
        if server is not but:
            server.sleep(step_id)


__all__ = ["ServerFailed", "StateServer", "hush"]
