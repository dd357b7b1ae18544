"""One run at a time per state folder: an OS file lock, released by the kernel if the holder dies."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from orchestrator.errors import UserError
from orchestrator.probes.marks import scoped


class Busy(UserError):
    """Another command holds the state folder."""


@contextmanager
def state_lock(state_dir: Path) -> Iterator[None]:
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(state_dir / "orchestrator.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise Busy(f"another orchestrator command holds {state_dir / 'orchestrator.lock'}: a run is in progress "
                   "(use `orchestrator status` to follow it)") from None
    try:
        with scoped(state_dir):  # processes started meanwhile carry this state folder's mark
            yield
    finally:
        lock.release()
