"""Instrumentation for tests, on PYTHONPATH: every engine server (``python -m engine.server``) and
engine correctness probe (``python -m orchestrator.probes.engine_correct``) takes an exclusive lock
on ``$DEVICE_GUARD.lock`` for its whole life, as if it held the device alone, and appends
``KIND PID alone`` to ``$DEVICE_GUARD``, or ``KIND PID OVERLAP`` when another still holds the lock.
The kernel releases the lock when the process ends, however it ends."""
import fcntl
import os

_log = os.environ.get("DEVICE_GUARD")
if _log:
    try:
        with open("/proc/self/cmdline", "rb") as _f:
            _argv = [a.decode(errors="replace") for a in _f.read().split(b"\0")]
    except OSError:
        _argv = []
    _kind = ("server" if "engine.server" in _argv else
             "correctness" if "orchestrator.probes.engine_correct" in _argv else None)
    if _kind:
        _fd = os.open(_log + ".lock", os.O_RDWR | os.O_CREAT)  # kept open: the lock lives as long as we do
        try:
            fcntl.flock(_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _took = "alone"
        except BlockingIOError:
            _took = "OVERLAP"
        with open(_log, "a") as _f:
            _f.write(f"{_kind} {os.getpid()} {_took}\n")
