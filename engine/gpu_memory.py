"""Who holds a GPU's memory: named in the engine's "not enough free memory" errors, because the
usual cause on a shared card is another process (a server left running, a second engine)."""
from __future__ import annotations

import shutil
import subprocess

GIB = float(1 << 30)


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        return " ".join(a.decode(errors="replace") for a in argv if a)[:120] or "?"
    except OSError:
        return "?"


def _from_nvml(index: int | None) -> list[tuple[int, int]] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            indices = [index] if index is not None else range(pynvml.nvmlDeviceGetCount())
            return [(p.pid, int(p.usedGpuMemory or 0)) for i in indices
                    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))]
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None


def _from_nvidia_smi(index: int | None) -> list[tuple[int, int]] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    which = ["-i", str(index)] if index is not None else []
    try:
        out = subprocess.run(["nvidia-smi", *which, "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    found = []
    for line in out.stdout.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit():
            found.append((int(pid), int(float(mib.strip() or 0)) << 20))
    return found


def holders(index: int | None) -> list[tuple[int, int, str]]:
    """(pid, bytes, command line) of each process with memory on GPU ``index`` (every GPU: None),
    largest first; empty when neither NVML nor nvidia-smi can tell."""
    procs = _from_nvml(index)
    if procs is None:
        procs = _from_nvidia_smi(index) or []
    return sorted(((pid, used, _command_line(pid)) for pid, used in procs), key=lambda p: -p[1])


def describe_holders(index: int, own_pid: int | None = None) -> str:
    """A sentence for an error message: which processes hold the card, or that none could be named."""
    found = holders(index)
    if not found:
        return "no process holding it could be named (NVML and nvidia-smi unavailable or silent)"
    parts = [f"pid {pid}{' (this process)' if pid == own_pid else ''} {used / GIB:.1f} GiB: {cmd}"
             for pid, used, cmd in found]
    return "processes holding it: " + "; ".join(parts)


def wait_released(pids: set[int], timeout: float) -> set[int]:
    """Wait until none of ``pids`` holds memory on any GPU (the driver frees a process's memory a
    little after it exits); returns those still listed at the deadline."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        left = {pid for pid, _, _ in holders(None)} & pids
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
