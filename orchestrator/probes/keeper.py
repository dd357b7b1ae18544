"""Runs a step's process that may change a target root, and records when it ended and what it changed there.

`python -I keeper.py SPEC -- ARGV...`, started by run_process in a session of its own. It starts ARGV in another
session and waits until ARGV exits or its own stdin closes (the orchestrator died, or gave up on ARGV at its
timeout). Then it kills every process ARGV left: as the child subreaper, it inherits even those that double-forked
away, so when it has reaped its last child none is left. Only then it takes a time of the file system's clock and
compares the root with the step's snapshot, and appends to the intent log (intents.py) what the step's processes
changed before that time: what changed later is someone else's (recovery.py). A path changed again after that time
is named as such. It reports ARGV's exit status (or why it could not start) on the file descriptor SPEC names.

Standalone: the standard library, psutil and the orchestrator's images and intents modules only.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

if __name__ == "__main__":  # run with -I: the orchestrator's package is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from orchestrator import images  # noqa: E402
from orchestrator.intents import Intents  # noqa: E402

ENV = "ORCHESTRATOR_KEEPER"  # in a keeper's environment (not its command's): the state folder's scope
PR_SET_CHILD_SUBREAPER = 36


def end_all() -> None:
    """Kill every process left under this one, and their process groups, round after round until none is left:
    the children of one killed are this one's in the next round."""
    while True:
        for pid in (child.pid for child in psutil.Process().children()):
            for kill, target in ((os.killpg, _group(pid)), (os.kill, pid)):
                if target is not None:
                    try:
                        kill(target, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        time.sleep(0.001)


def _group(pid: int) -> int | None:
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return None
    return group if group != os.getpgrp() else None


class Stop(Exception):
    """The keeper was asked to stop (SIGTERM, SIGHUP, SIGINT): it ends ARGV and records, as when its stdin closes."""


def _stop(signum, frame) -> None:
    raise Stop


def wait(child: subprocess.Popen, life: int) -> int | None:
    """ARGV's exit status, or None when `life` (stdin) closed or a stop signal came first."""
    try:
        waits = [life, os.pidfd_open(child.pid)], None
    except (AttributeError, OSError):  # before Linux 5.3: look every 10 ms
        waits = [life], 0.01
    try:
        while True:
            ready, _, _ = select.select(waits[0], [], [], waits[1])
            if child.poll() is not None:
                return child.returncode
            if life in ready and not os.read(life, 4096):
                return None
    except Stop:
        return None


def clock(path: Path) -> int:
    """A time of the file system's clock (ns) after every process ended: a change stamped earlier came before it.
    Stamped on the intent log itself, once the clock has moved past the stamp that could equal a last change."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.utime(fd)
        first = os.fstat(fd).st_mtime_ns
        while True:
            time.sleep(0.001)
            os.utime(fd)
            if (now := os.fstat(fd).st_mtime_ns) > first:
                return now
    finally:
        os.close(fd)


def changes(root: Path, snapshot: dict, end: int) -> tuple[dict[str, list], list[str]]:
    """({path: [image, mode]} changed before `end` against the snapshot, [snapshot paths changed again since])."""
    entries, ctimes = images.manifest_entries(snapshot), snapshot.get("ctimes", {})
    changed: dict[str, list] = {}
    later: list[str] = []
    seen = set()
    for rel, path, st in images.walk(root):
        seen.add(rel)
        if ctimes.get(rel) == st.st_ctime_ns:
            continue
        try:
            image = images.read(path, st)
            again = os.lstat(path).st_ctime_ns != st.st_ctime_ns
        except (OSError, images.TouchError):
            image, again = None, True
        if st.st_ctime_ns >= end or again:
            if rel in entries:
                later.append(rel)
            continue  # new since the end: someone else's
        if not images.same(image, tuple(entries.get(rel, (None, None)))):
            changed[rel] = list(image)
    for rel in entries.keys() - seen:  # gone: its folder changed when it went, and tells when
        folder = next(p for p in (root / rel).parents if os.path.lexists(p))
        if os.lstat(folder).st_ctime_ns < end:
            changed[rel] = [None, None]
        else:
            later.append(rel)
    return changed, later


def main() -> int:
    spec, argv = json.loads(sys.argv[1]), sys.argv[3:]
    report = os.fdopen(spec["report"], "w")
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    stops = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    for signum in stops:  # while ARGV is waited for, a stop ends it; nothing stops the record (ARGV gets defaults)
        signal.signal(signum, lambda *_: None)
    intents = Intents(Path(spec["state"]))
    record = {**spec["record"], "process": f"{os.getpid()}.{time.time_ns()}"}
    intents.add([{**record, "started": True}])
    env = {k: v for k, v in os.environ.items() if k != ENV}
    try:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    except OSError as e:
        status = {"errno": e.errno, "error": e.strerror or str(e)}
    else:
        for signum in stops:
            signal.signal(signum, _stop)
        returncode = wait(child, sys.stdin.fileno())
        for signum in stops:
            signal.signal(signum, signal.SIG_IGN)
        status = {"returncode": returncode if returncode is not None else -signal.SIGKILL}
    end_all()
    end = clock(intents.path)
    snapshot = json.loads(Path(spec["snapshot"]).read_bytes())
    changed, later = changes(Path(spec["root"]), snapshot, end)
    intents.add([{**record, "ended": end, "changed": changed, "later": later}])
    report.write(json.dumps(status) + "\n")
    report.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
