"""Marks in the environment of every process the orchestrator starts, so that none escapes.

A probe or a command step may fork twice and call setsid: its process then leaves both the process
group and the tree under the orchestrator, and no kill aimed at either reaches it. Its environment
still holds what it inherited, so each process started by `run_process` gets
``ORCHESTRATOR_PROCESS_MARK=<scope>.<uuid>`` (added to any mark it inherited), and reading the
environment of every process (``/proc/<pid>/environ``, through psutil) finds them all: one mark is
swept when its process ends or times out, a whole scope (one state folder) by `recover`, which finds
what a crashed run left even where no row recorded it.

Not reached: a process that replaces its environment (``env -i``) or runs as another user.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import psutil

from orchestrator.probes.keeper import ENV as KEEPER_ENV

MARK = "ORCHESTRATOR_PROCESS_MARK"
UNSCOPED = "none"
_scope = UNSCOPED  # the state folder whose lock this process holds, if any


def scope_of(state_dir: Path) -> str:
    return "s" + hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:16]


@contextmanager
def scoped(state_dir: Path) -> Iterator[None]:
    """While held (with the state folder's lock), processes started get marks of this state folder."""
    global _scope
    previous, _scope = _scope, scope_of(state_dir)
    try:
        yield
    finally:
        _scope = previous


def new_mark() -> str:
    return f"{_scope}.{uuid.uuid4().hex}"


def marked_env(env: dict[str, str], mark: str) -> dict[str, str]:
    inherited = env.get(MARK)
    return {**env, MARK: f"{inherited} {mark}" if inherited else mark}


def _spared() -> set[int]:
    """This process and its ancestors: an orchestrator started by a marked process must not kill itself."""
    me = psutil.Process()
    return {me.pid, *(p.pid for p in me.parents())}


def marked(test: Callable[[list[str]], bool], since: float | None = None) -> list[psutil.Process]:
    """Live processes whose marks pass `test`; `since` (epoch seconds) skips older ones without reading them."""
    return _living(lambda env: bool(env.get(MARK)) and test(env[MARK].split()), since)


def _living(test: Callable[[dict], bool], since: float | None = None) -> list[psutil.Process]:
    """Live processes whose environment passes `test`."""
    spared = _spared()
    found = []
    for proc in psutil.process_iter(["create_time"]):
        if proc.pid in spared or (since is not None and (proc.info["create_time"] or 0) < since):
            continue
        try:
            if test(proc.environ()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:  # gone, a zombie, or another user's
            continue
    return found


def wait_keepers(state_dir: Path, timeout: float) -> None:
    """Let the keepers (keeper.py) of the state folder's step processes end their processes and record what those
    changed, for up to `timeout` seconds: a dead run's keepers do so right after it died."""
    scope = scope_of(state_dir)
    psutil.wait_procs(_living(lambda env: env.get(KEEPER_ENV) == scope), timeout=timeout)


def sweep(test: Callable[[list[str]], bool], since: float | None = None, rounds: int = 100) -> int:
    """SIGKILL every process whose marks pass `test`, round after round until none is left: a child forked
    while a round ran is found by the next. Returns how many were killed."""
    killed = 0
    for _ in range(rounds):
        procs = marked(test, since)
        if not procs:
            break
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass
        killed += len(procs)
        psutil.wait_procs(procs, timeout=1)
    return killed


def sweep_mark(mark: str, since: float | None = None) -> int:
    """Every process that inherited `mark`."""
    return sweep(lambda marks: mark in marks, since)


def sweep_scope(state_dir: Path) -> int:
    """Every process started for the state folder, by any run: call only while holding its lock."""
    prefix = scope_of(state_dir) + "."
    return sweep(lambda marks: any(m.startswith(prefix) for m in marks))
