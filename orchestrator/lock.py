"""One command at a time per state folder, and per target root: OS file locks, released by the kernel if the
holder dies. Two configs with different state folders may name the same target: each would measure and restore
files the other changes, so a target root is locked too, wherever its state folder is."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from filelock import FileLock, Timeout

from orchestrator.errors import UserError
from orchestrator.loading import ConfigError
from orchestrator.probes.marks import scoped

LOCK_DIR_ENV = "ORCHESTRATOR_LOCK_DIR"


class Busy(UserError):
    """Another command holds the state folder or a target root."""


def lock_dir() -> Path:
    """Where target roots are locked: one folder for every state folder on this machine."""
    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "orchestrator-locks")


def _holder_file(lock_file: Path) -> Path:
    return lock_file.with_name(lock_file.name + ".holder")


def _holder(lock_file: Path) -> str:
    try:
        h = json.loads(_holder_file(lock_file).read_text(encoding="utf-8"))
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"]))
        return f"pid {h['pid']}, state folder {h['state']}, command `{h['command']}`, since {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"holder not recorded in {_holder_file(lock_file)}"


@contextmanager
def _locked(lock_file: Path, state_dir: Path, refusal: str) -> Iterator[None]:
    """Hold `lock_file`, with who holds it written beside it; `refusal` + the holder when it is taken."""
    lock = FileLock(str(lock_file), mode=0o666)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise Busy(f"{refusal} (held by {_holder(lock_file)})") from None
    holder = _holder_file(lock_file)
    try:
        tmp = holder.with_name(f"{holder.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"pid": os.getpid(), "state": str(state_dir), "started": time.time(),
                                   "command": shlex.join(getattr(sys, "orig_argv", sys.argv))}), encoding="utf-8")
        os.chmod(tmp, 0o666)
        tmp.replace(holder)
    except OSError:
        pass  # the lock is what matters; the note only helps the refused command name its holder
    try:
        yield
    finally:
        holder.unlink(missing_ok=True)  # before the release: afterwards it may be the next holder's
        lock.release()


def held(state_dir: Path) -> bool:
    """Whether some command holds the state folder's lock now (asked without waiting; from any process that
    shares the file, whatever its pid namespace). Taking it shared for an instant could refuse a command starting
    at that very instant, so ask only when a process cannot be found otherwise."""
    import fcntl
    try:
        fd = os.open(state_dir / "orchestrator.lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing releases a lock taken
    return False


@contextmanager
def state_lock(state_dir: Path) -> Iterator[None]:
    state_dir.mkdir(parents=True, exist_ok=True)
    with _locked(state_dir / "orchestrator.lock", state_dir,
                 f"another orchestrator command holds {state_dir / 'orchestrator.lock'}: a run is in progress "
                 "(use `orchestrator status` to follow it)"):
        with scoped(state_dir):  # processes started meanwhile carry this state folder's mark
            yield


@contextmanager
def target_lock(roots: Iterable[Path], state_dir: Path) -> Iterator[None]:
    """A lock per target root (by real path), in a machine-wide folder, so that it binds every state folder."""
    folder = lock_dir()
    try:
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            os.chmod(folder, 0o1777)  # shared by every user, like /tmp
    except OSError as e:
        raise UserError(f"cannot create the lock folder {folder}: {e.strerror or e} (set {LOCK_DIR_ENV} to a "
                        "writable folder)") from None
    with ExitStack() as stack:
        for root in sorted({os.path.realpath(r) for r in roots}):
            key = hashlib.sha256(root.encode()).hexdigest()[:32]
            stack.enter_context(_locked(folder / f"root-{key}.lock", state_dir,
                                        f"the target root {root} is in use by another orchestrator command"))
        yield


@contextmanager
def project_lock(project, need_roots: bool = True) -> Iterator[None]:
    """The state folder's lock, then its target roots'. Without `need_roots`, roots that cannot be located
    (a vllm target where vllm is gone) are not locked: `recover` restores recorded paths all the same."""
    with state_lock(project.state_dir):
        try:
            roots = list(project.target.roots.values())
        except ConfigError:
            if need_roots:
                raise
            roots = []
        with target_lock(roots, project.state_dir):
            yield
