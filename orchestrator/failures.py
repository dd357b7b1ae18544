"""Failures of the machine under a command (a full disk, a read-only file system, a damaged history database), said
as what happened, to which file, and what to do; unlike a plugin's own failure, which fails only that plugin."""
from __future__ import annotations

import errno
import sqlite3

# Errors that say the machine or the state folder failed, not the plugin being staged.
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ENOMEM}
RECOVER = "run `orchestrator recover` (or the next `run` or `rollback`, which recover first) to put back what the " \
          "stopped command left"


def is_environment(e: BaseException) -> bool:
    return isinstance(e, sqlite3.DatabaseError) or (isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS)


def describe_os_error(e: OSError, recovered: bool = False) -> str:
    where = e.filename if e.filename is not None else "(no file named)"
    what = f"{where}: {e.strerror or e}"
    then = "then run again: the target is back at its last kept state" if recovered else f"then {RECOVER}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{what}: the disk is full. Free some space, {then}"
    if e.errno == errno.EROFS:
        return f"{what}: the file system is read-only. Make it writable, {then}"
    return what


def describe(e: BaseException, recovered: bool = False) -> str:
    """One line for a failure of the machine under a command; `recovered`: the target was put back already."""
    if isinstance(e, OSError):
        return describe_os_error(e, recovered)
    if isinstance(e, sqlite3.DatabaseError):
        from orchestrator.store import OPENED, problem
        return str(problem(OPENED[-1], e)) if OPENED else str(e)
    from orchestrator.errors import UserError
    if isinstance(e, UserError):
        return str(e)
    return f"{type(e).__name__}: {e}"
