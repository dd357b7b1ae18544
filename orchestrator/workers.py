"""Screening workers on Ray: one actor per worker, each holding a GPU as a Ray resource (`num_gpus=1`, so that Ray,
not this code, sets its CUDA_VISIBLE_DEVICES) where the target runs on GPUs, else a CPU. A local cluster on this
host by default, or an existing one (`--ray-address`). Jobs go to idle workers and come back as they finish
(`ray.wait`); a worker that dies gives back a `Lost`.

Imported only when a run screens on workers: Ray is an optional extra (`.[ray]`).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from contextlib import contextmanager
from typing import Callable, Iterator

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError, WorkerCrashedError

from orchestrator import sandbox
from orchestrator.prober import EnvironmentFailed
from orchestrator.probes.marks import sweep_mark

LOCAL = "local"  # --ray-address value that starts a local cluster, as no address does
PLACEMENT_TIMEOUT = 120  # seconds for the cluster to place every worker
GONE = (RayActorError, WorkerCrashedError)


class Refused(Exception):
    """The cluster cannot give the workers; `address`: its address is at fault."""

    def __init__(self, message: str, address: bool = False):
        super().__init__(message)
        self.address = address


@dataclass
class Lost:
    """A job whose worker died under it, or failed it with an error of its own."""
    worker: str
    why: str


class RemoteSide:
    """A duet's partner worker as the worker that judges sees it (pairing.Partner): it copies its folder as soon as
    the job starts, samples the arm asked for, and gives back what it recorded at the end."""

    def __init__(self, handle, name: str, job: sandbox.Job):
        self.handle, self.name, self.job = handle, name, job
        self.prepared = handle.prepare.remote(job)
        self.seconds = 0.0

    def _get(self, ref):
        try:
            return ray.get(ref)
        except GONE as e:
            raise EnvironmentFailed(f"the partner worker {self.name} died: {_gist(e)}") from None
        except RayTaskError as e:
            cause = e.cause if isinstance(e.cause, Exception) else e
            raise cause from None

    def ready(self, pinned: str | None) -> None:
        try:
            self._get(self.prepared)
        except EnvironmentFailed:
            raise
        except Exception as e:  # noqa: BLE001 - the candidate applied here too: its copy failed on this worker
            raise EnvironmentFailed(f"the partner worker {self.name} could not apply the candidate: {e}") from None
        self._get(self.handle.pin.remote(pinned))

    def sample(self, label: str, n: int, start_at: float):
        started = time.monotonic()
        ref = self.handle.sample.remote(label, n, start_at)

        def wait():
            s = self._get(ref)
            self.seconds += time.monotonic() - started
            s.server = None if s.server is None else f"{self.name}:{s.server}"  # its own history's numbering
            return s
        return wait

    def restart(self) -> None:
        self._get(self.handle.restart.remote())

    def overlap(self) -> float:
        """Seconds its samples took: one worker would have spent them in turn."""
        return self.seconds

    def finish(self) -> tuple[str, dict[str, list[dict]]]:
        try:
            return self.name, self._get(self.handle.finish.remote())
        except Exception:  # noqa: BLE001 - what it recorded is on disk all the same
            return self.name, sandbox.recorded(self.job.folder("partner"))[1]


@ray.remote(max_restarts=0)
class Worker:
    """One screening worker. Ray placed it: its GPU, if it has one, is the only one it sees."""

    def __init__(self, name: str):
        self.name = name
        self.duo: sandbox.Duo | None = None

    def where(self) -> dict:
        return {"gpus": [str(g) for g in ray.get_gpu_ids()], "node": ray.util.get_node_ip_address()}

    def name_as(self, name: str) -> None:
        self.name = name

    def screen(self, job: sandbox.Job, partner=None, partner_name: str = "") -> sandbox.Screened:
        side = RemoteSide(partner, partner_name, job) if partner is not None else None
        return sandbox.screen(job, self.name, side)

    def control(self, job: sandbox.Job, probes: list[str]) -> sandbox.Checked:
        return sandbox.control(job, self.name, probes)

    # a duet's partner
    def prepare(self, job: sandbox.Job) -> None:
        if self.duo is not None:
            self.duo.finish()
        self.duo = None
        self.duo = sandbox.Duo(job)

    def pin(self, pinned: str | None) -> None:
        self.duo.pin(pinned)

    def sample(self, label: str, n: int, start_at: float):
        return self.duo.sample(label, n, start_at)

    def restart(self) -> None:
        self.duo.restart()

    def finish(self) -> dict[str, list[dict]]:
        duo, self.duo = self.duo, None
        return duo.finish() if duo is not None else {}


class Slot:
    """What one job takes: a worker, or two for a duet (the first judges)."""

    def __init__(self, members: list[tuple[str, object]]):
        self.members = members

    @property
    def name(self) -> str:
        return "+".join(name for name, _ in self.members)


class Pool:
    """The run's workers: jobs submitted in turn go to idle slots; `next` gives each back as it ends."""

    def __init__(self, slots: list[Slot]):
        self.slots = slots
        self.idle = list(slots)
        self.queue: list[tuple[sandbox.Job, list[str] | None, str | None]] = []  # (job, probes, slot to avoid)
        self.running: dict = {}  # object ref: (job, probes, slot)

    @property
    def size(self) -> int:
        return sum(len(s.members) for s in self.slots)

    def submit(self, job: sandbox.Job, probes: list[str] | None = None, avoid: str | None = None) -> None:
        """Screen the job's candidate (`probes` None), or re-check these probes on its kept state (a control), on
        a worker other than `avoid`."""
        self.queue.append((job, probes, avoid))
        self._start()

    def others(self, avoid: str) -> bool:
        """Whether a slot other than `avoid` is left to take a job."""
        return any(s.name != avoid for s in self.slots)

    def pending(self) -> bool:
        """Whether a job is running, or queued with a worker left to run it."""
        return bool(self.running or (self.queue and self.slots))

    def stranded(self) -> list[tuple[sandbox.Job, list[str] | None]]:
        """The queued jobs no worker is left to run (taken out of the queue)."""
        if self.slots:
            return []
        left, self.queue = [(job, probes) for job, probes, _ in self.queue], []
        return left

    def _start(self) -> None:
        for item in list(self.queue):
            job, probes, avoid = item
            slot = next((s for s in self.idle if s.name != avoid), None)
            if slot is None:
                continue
            self.queue.remove(item)
            self.idle.remove(slot)
            (_, leader), rest = slot.members[0], slot.members[1:]
            if probes is not None:
                ref = leader.control.remote(job, probes)
            elif rest:
                ref = leader.screen.remote(job, rest[0][1], rest[0][0])
            else:
                ref = leader.screen.remote(job)
            self.running[ref] = (job, probes, slot)

    def next(self, tick: Callable[[float], None]) -> tuple[sandbox.Job, list[str] | None, str, object]:
        """The next job to end: (job, its control probes or None, its slot's name, Screened | Checked | Lost). A
        slot whose environment failed under a job (it died, raised, or its control failed too) takes no more: what
        it left running is swept."""
        started = time.monotonic()
        while True:
            with _signals():
                done, _ = ray.wait(list(self.running), num_returns=1, timeout=0.5)
            if done:
                break
            tick(time.monotonic() - started)
        job, probes, slot = self.running.pop(done[0])
        try:
            result = ray.get(done[0])
        except GONE as e:
            result = Lost(slot.name, _gist(e))
        except RayTaskError as e:
            result = Lost(slot.name, _gist(e.cause if e.cause is not None else e))
        if isinstance(result, Lost) or getattr(result, "failed", None):
            sweep_mark(job.mark)
            self.slots.remove(slot)
        else:
            self.idle.append(slot)
        self._start()
        return job, probes, slot.name, result

    def cancel(self) -> None:
        """Stop every job still running: its workers are killed (what they started is swept with the run's marks)."""
        for ref, (job, _, slot) in list(self.running.items()):
            for _, handle in slot.members:
                ray.kill(handle)
            sweep_mark(job.mark)
        self.running.clear()
        self.queue.clear()

    def close(self) -> None:
        self.cancel()
        ray.shutdown()


@contextmanager
def _signals() -> Iterator[None]:
    """A signal handler's exception (the run's SIGTERM, Ctrl-C) raised while Ray's own code waits comes out as a
    SystemError around it: it is raised as itself."""
    try:
        yield
    except SystemError as e:
        if isinstance(e.__cause__, BaseException) and not isinstance(e.__cause__, Exception):
            raise e.__cause__ from None
        raise


def _gist(error: BaseException) -> str:
    """What an error says first: Ray's go on for lines of advice."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text.split(". ")[0][:300]


def _reachable(address: str) -> None:
    """A cluster's address answers on its port: Ray itself would wait minutes before saying it does not."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise Refused(f"{address!r} is not HOST:PORT (the head node's address, as `ray start --head` prints it) nor "
                      f"`{LOCAL}`", address=True)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise Refused(f"nothing answers at {address} ({e.strerror or e}): start the cluster (`ray start --head`) "
                      "or name its head node's address", address=True) from None


def connect(workers: int, gpus: bool, address: str | None, duet: bool) -> Pool:
    """Start a local cluster (no address, or `local`) or join one, and place `workers` workers on it, each with a
    GPU where `gpus`; Refused when it cannot. The workers import this package from where it is here."""
    if address not in (None, LOCAL):
        _reachable(address)
    here = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    options = dict(logging_level=logging.ERROR, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    started_here = address in (None, LOCAL)
    try:
        if started_here:
            ray.init(address=LOCAL, num_cpus=max(workers, os.cpu_count() or 1), include_dashboard=False,
                     object_store_memory=100 << 20, **options)
        else:
            ray.init(address=address, **options)
    except Exception as e:  # noqa: BLE001 - whatever Ray says, nothing of the run has started
        raise Refused(f"cannot {'start' if started_here else 'join'} a Ray cluster: {_gist(e)}",
                      address=not started_here) from None
    resource = "GPU" if gpus else "CPU"
    have = int(ray.cluster_resources().get(resource, 0))
    if have < workers:
        ray.shutdown()
        raise Refused(f"{workers} workers need {workers} {resource}s; the Ray cluster "
                      f"{'started here' if started_here else 'at ' + address} has {have}")
    handles = [Worker.options(num_cpus=1, num_gpus=1 if gpus else 0).remote(f"w{i + 1}") for i in range(workers)]
    try:
        places = ray.get([h.where.remote() for h in handles], timeout=PLACEMENT_TIMEOUT)
    except GetTimeoutError:
        ray.shutdown()
        raise Refused(f"the Ray cluster did not place {workers} workers within {PLACEMENT_TIMEOUT} s (its free "
                      f"{resource}s are fewer)") from None
    nodes = {p["node"] for p in places}
    # Ray hands out GPUs in whatever order the actors come up: names follow the node and GPU order instead, so that
    # w1 is the first GPU of the first node on every run
    placed = sorted(zip(handles, places), key=lambda hp: (hp[1]["node"], [(len(g), g) for g in hp[1]["gpus"]]))
    named = []
    for i, (handle, place) in enumerate(placed):
        where = [place["node"]] if len(nodes) > 1 else []
        where += [f"GPU {','.join(place['gpus'])}"] if place["gpus"] else []
        name = f"w{i + 1}" + (f" ({' '.join(where)})" if where else "")
        ray.get(handle.name_as.remote(name))
        named.append((name, handle))
    size = 2 if duet else 1
    slots = [Slot(named[i:i + size]) for i in range(0, len(named) - size + 1, size)]
    return Pool(slots)
