"""The environment a measurement was taken in, so that decisions taken elsewhere can be shown stale.

Versions come from package metadata rather than imports: importing torch or vllm costs seconds
and may initialise a GPU, and a fingerprint is taken with every measurement.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shutil
import socket
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

from orchestrator.errors import UserError

# What changes measured speed; python and platform are informative only. The CPU counts too: a serving engine that
# schedules from Python is bound by it (one state measured 144,000 on one lent H100 and 72,000 on another, both
# hosts called "vm": nothing recorded told the machines apart).
STALE_KEYS = ("host", "gpu", "gpu_count", "gpu_driver", "cuda", "torch", "triton", "vllm", "cpu_governor", "cpu",
              "cpus")

GOVERNOR = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
CPUINFO = Path("/proc/cpuinfo")
NVIDIA_SMI_TIMEOUT = 10


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi(*args: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _gpu() -> dict[str, Any]:
    """GPU names (comma-joined when several differ), driver and the driver's CUDA version from nvidia-smi."""
    listing = _nvidia_smi("--query-gpu=name,driver_version", "--format=csv,noheader")
    if not listing:
        return {"gpu": None, "gpu_count": 0, "gpu_driver": None, "cuda": None}
    rows = [[part.strip() for part in line.split(",")] for line in listing.splitlines() if line.strip()]
    names = sorted({row[0] for row in rows})
    drivers = sorted({row[1] for row in rows if len(row) > 1})
    header = _nvidia_smi() or ""
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return {"gpu": ", ".join(names), "gpu_count": len(rows), "gpu_driver": ", ".join(drivers) or None,
            "cuda": cuda.group(1) if cuda else None}


GPU_NOW = {"sm_mhz": "clocks.sm", "memory_mhz": "clocks.mem", "temperature_c": "temperature.gpu",
           "power_w": "power.draw", "clock_events": "clocks_event_reasons.active"}


def gpu_now() -> list[dict[str, float | str | None]] | None:
    """Each GPU's clocks, temperature, power and active clock-event (throttle) reasons, read now: a speed that
    drifts within a run is told from the machine's by these (None without nvidia-smi)."""
    listing = _nvidia_smi(f"--query-gpu={','.join(GPU_NOW.values())}", "--format=csv,noheader,nounits")
    if not listing:
        return None
    gpus = []
    for line in listing.splitlines():
        if not line.strip():
            continue
        values = [part.strip() for part in line.split(",")]
        row: dict[str, float | str | None] = {}
        for key, value in zip(GPU_NOW, values):
            try:
                row[key] = value if key == "clock_events" else float(value)
            except ValueError:  # "[N/A]", "[Not Supported]"
                row[key] = None
        gpus.append(row)
    return gpus


def _governor() -> str | None:
    try:
        return GOVERNOR.read_text().strip() or None
    except OSError:
        return None


def _cpu() -> str | None:
    """The CPU's model name (the first processor's; None where the kernel does not say)."""
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        return None
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return " ".join(found.group(1).split()) if found else None


def _cpus() -> int | None:
    """The cores this process may run on (a container's or a VM's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


@lru_cache(maxsize=1)
def _cached() -> tuple[tuple[str, Any], ...]:
    info = {
        "host": socket.gethostname(),
        **_gpu(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "vllm": _version("vllm"),
        "cpu_governor": _governor(),
        "cpu": _cpu(),
        "cpus": _cpus(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    return tuple(info.items())


def fingerprint(refresh: bool = False) -> dict[str, Any]:
    """The current environment; cached per process (drivers do not change under a running process)."""
    if refresh:
        _cached.cache_clear()
    return dict(_cached())


def environment() -> dict[str, Any]:
    """The current fingerprint; ORCHESTRATOR_FINGERPRINT_EXTRA (a JSON object) overrides keys of it, to mark a
    change the fingerprint cannot see (new firmware, another node pool) so that earlier decisions show stale."""
    info = fingerprint()
    extra = os.environ.get("ORCHESTRATOR_FINGERPRINT_EXTRA")
    if extra:
        try:
            overrides = json.loads(extra)
        except ValueError as e:
            raise UserError(f"environment variable ORCHESTRATOR_FINGERPRINT_EXTRA: not JSON: {e}") from None
        if not isinstance(overrides, dict):
            raise UserError("environment variable ORCHESTRATOR_FINGERPRINT_EXTRA: must be a JSON object")
        info = {**info, **overrides}
    return info


def differences(recorded: dict[str, Any] | None, current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Keys of STALE_KEYS whose values differ, as ``{key: (recorded, current)}``.

    A key missing from the recorded fingerprint (taken by an older version) is unknown, not a
    difference; no recorded fingerprint at all makes every known key differ.
    """
    if recorded is None:
        return {key: (None, current.get(key)) for key in STALE_KEYS if current.get(key) is not None}
    return {key: (recorded[key], current.get(key)) for key in STALE_KEYS
            if key in recorded and recorded[key] != current.get(key)}


def is_stale(recorded: dict[str, Any] | None, current: dict[str, Any] | None = None) -> bool:
    """Whether a decision measured under ``recorded`` may not hold under ``current`` (default: now)."""
    return bool(differences(recorded, fingerprint() if current is None else current))


def describe(recorded: dict[str, Any] | None, current: dict[str, Any] | None = None) -> str:
    """One line for ``status``: what changed since the decision was measured, or an empty string."""
    diff = differences(recorded, fingerprint() if current is None else current)
    return "; ".join(f"{key} {old} -> {new}" for key, (old, new) in diff.items())
