"""One command at a time per state folder, and per target: OS locks (flock), released by the kernel if the holder
dies.

The state folder is locked on its `orchestrator.lock` file. A target root is locked on its folder itself:
exclusively, and every folder above it shared. Two commands whose roots are one folder, or one inside the other,
then ask for the same folder in modes that exclude each other, whatever their state folders and environments: the
lock belongs to the folder, not to a name in some shared place, so nothing is created for it and no link can be
planted in its way. The refusal finds the holder through /proc/locks and the note its state folder holds.
"""
from __future__ import annotations

import fcntl
import json
import os
import shlex
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from orchestrator.errors import UserError
from orchestrator.loading import ConfigError
from orchestrator.probes.marks import scoped

LOCK_NAME = "orchestrator.lock"
HOLDER_NAME = LOCK_NAME + ".holder"


class Busy(UserError):
    """Another command holds the state folder or a target root."""


def _open(path: Path) -> int:
    """A descriptor to lock the file `path` by, created if missing; never through a symlink (UserError naming it),
    and an existing file's bytes and mode are left as they are."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise UserError(f"{path} is a symlink, not a lock file: remove it, then run again") from None
        raise UserError(f"cannot open {path} to lock it: {e.strerror or e}") from None


def _try(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _note(state_dir: Path) -> dict | None:
    """The holder note of a state folder, read without following a link."""
    try:
        fd = os.open(state_dir / HOLDER_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, encoding="utf-8") as f:
            note = json.load(f)
        return note if isinstance(note, dict) else None
    except (OSError, ValueError):
        return None


def _describe(note: dict | None, state_dir: Path) -> str:
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(note["started"]))
        return f"pid {note['pid']}, state folder {note['state']}, command `{note['command']}`, since {started}"
    except (KeyError, TypeError, ValueError, OverflowError):
        return f"holder not recorded in {state_dir / HOLDER_NAME}"


def _write_note(state_dir: Path, roots: list[str]) -> None:
    """Who holds the state folder, for a refused command to name: written to a new file of a random name (never
    through a link, nobody else's file opened), then renamed over the note."""
    try:
        fd, tmp = tempfile.mkstemp(dir=state_dir, prefix=f".{HOLDER_NAME}.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "state": str(state_dir), "started": time.time(), "roots": roots,
                       "command": shlex.join(getattr(sys, "orig_argv", sys.argv))}, f)
            os.fchmod(f.fileno(), 0o644)  # a file of its own: readable by whoever shares the folder
        os.replace(tmp, state_dir / HOLDER_NAME)
    except OSError:
        pass  # the lock is what matters; the note only helps a refused command name its holder


def held(state_dir: Path) -> bool:
    """Whether some command holds the state folder's lock now (asked without waiting; from any process that
    shares the file, whatever its pid namespace). Taking it shared for an instant could refuse a command starting
    at that very instant, so ask only when a process cannot be found otherwise."""
    try:
        fd = os.open(state_dir / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return not _try(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)  # closing releases a lock taken


@contextmanager
def state_lock(state_dir: Path, roots: Iterable[Path] = ()) -> Iterator[None]:
    state_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        fd = _open(state_dir / LOCK_NAME)
        stack.callback(os.close, fd)  # closing releases the lock
        if not _try(fd, fcntl.LOCK_EX):
            raise Busy(f"another orchestrator command holds {state_dir / LOCK_NAME}: a run is in progress (use "
                       f"`orchestrator status` to follow it) (held by {_describe(_note(state_dir), state_dir)})")
        _write_note(state_dir, [os.path.realpath(r) for r in roots])
        stack.callback((state_dir / HOLDER_NAME).unlink, missing_ok=True)  # before the release: then it is the next's
        with scoped(state_dir):  # processes started meanwhile carry this state folder's mark
            yield


def _existing(path: str) -> str:
    """The real path of the folder `path` is, or of the nearest folder above it that exists (a root a command will
    create, such as the engine's workspace, is locked through the folder it will be made in)."""
    path = os.path.realpath(path)
    while not os.path.isdir(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


@contextmanager
def target_lock(roots: Iterable[Path]) -> Iterator[None]:
    """Each root's folder exclusively and every folder above it shared (one this user may not read is passed)."""
    mine = {_existing(str(r)) for r in roots}
    above = {str(p) for r in mine for p in Path(r).parents} - mine
    with ExitStack() as stack:
        for path, how in [(p, fcntl.LOCK_EX) for p in sorted(mine)] + [(p, fcntl.LOCK_SH) for p in sorted(above)]:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as e:
                if path in mine:
                    raise UserError(f"cannot open the target root {path} to lock it: {e.strerror or e}") from None
                continue
            stack.callback(os.close, fd)
            if not _try(fd, how):
                raise Busy(_refusal(path, fd, mine))
        yield


def _refusal(path: str, fd: int, mine: set[str]) -> str:
    """Why the lock of `path` (a root of ours, or a folder above one) is refused, naming who holds it."""
    ours = next(r for r in sorted(mine) if r == path or r.startswith(path.rstrip(os.sep) + os.sep))
    holders = _holders(fd)
    theirs = [r for _, roots in holders for r in roots if isinstance(r, str) and _overlap(r, ours)]
    what = f"overlaps the target root {theirs[0]} of" if theirs and theirs[0] != ours else "is in use by"
    who = "; ".join(description for description, _ in holders) or "holder not found"
    return f"the target root {ours} {what} another orchestrator command (held by {who})"


def _overlap(a: str, b: str) -> bool:
    a, b = a.rstrip(os.sep) + os.sep, b.rstrip(os.sep) + os.sep
    return a.startswith(b) or b.startswith(a)


def _holders(fd: int) -> list[tuple[str, list]]:
    """(who, their roots) for each process that /proc/locks names as holding a lock on the file `fd` is open on:
    told by the note of the state folder whose lock it holds, or by its pid alone."""
    found = []
    for pid in dict.fromkeys(_lockers(fd)):
        notes = [(_note(folder), folder) for folder in _state_folders(pid)]
        found += [(_describe(note, folder), (note or {}).get("roots", [])) for note, folder in notes]
        if not notes:
            found.append((f"pid {pid}", []))
    return found


def _lockers(fd: int) -> list[int]:
    """The pids of the locks /proc/locks lists on the file `fd` is open on (none where it cannot be read)."""
    st = os.fstat(fd)
    pids = []
    try:
        with open("/proc/locks", encoding="ascii") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 6 or fields[1] == "->":  # "->": a lock waited for, not held
                    continue
                major, minor, inode = fields[5].split(":")
                if (int(major, 16), int(minor, 16), int(inode)) == (os.major(st.st_dev), os.minor(st.st_dev),
                                                                     st.st_ino) and int(fields[4]) != os.getpid():
                    pids.append(int(fields[4]))
    except (OSError, ValueError):
        pass
    return pids


def _state_folders(pid: int) -> list[Path]:
    """The folders of the `orchestrator.lock` files the process has open: the state folders it holds."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    folders = []
    for name in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if os.path.basename(target) == LOCK_NAME:
            folders.append(Path(target).parent)
    return folders


@contextmanager
def project_lock(project, need_roots: bool = True) -> Iterator[None]:
    """The state folder's lock, then its target roots'. Without `need_roots`, roots that cannot be located
    (a vllm target where vllm is gone) are not locked: `recover` restores recorded paths all the same."""
    try:
        roots = list(project.target.roots.values())
    except ConfigError:
        if need_roots:
            raise
        roots = []
    with state_lock(project.state_dir, roots), target_lock(roots):
        yield
