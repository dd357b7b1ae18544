"""Where vLLM's engine-core process spends its time while it serves: py-spy's samples of it, summarised.

The engine core schedules, launches and samples every step from one Python thread. Where it, not the GPU, sets
a step's pace (the GPU under half busy at full clocks, the process at a whole core), its frames say which part
of the step costs the time: the model's forward launched eagerly, the scheduler, sampling.

    python3 profile.py record OUT [--seconds 15] [--py-spy PATH]   # the serving engine core, into OUT
    python3 profile.py summary RAW [--within FRAME] [--top 30]     # a recording (raw, or .gz) as shares
"""
from __future__ import annotations

import argparse
import gzip
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

# the process title as the kernel's 15-character comm holds it (psutil gives the whole title where vLLM's
# setproctitle also rewrote the command line: "VLLM::EngineCore")
ENGINE_CORE = "VLLM::EngineCor"
SERVING = "_process_engine_step"  # a frame every sample of a serving step holds (vLLM 0.34.0's busy loop)


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) format: one stack a line, its frames root first joined by ';', then a count."""
    opener = gzip.open if path.suffix == ".gz" else open
    stacks = []
    with opener(path, "rt") as f:
        for number, line in enumerate(f, 1):
            stack, space, count = line.rstrip("\n").rpartition(" ")
            if not space or not count.isdigit():
                raise ValueError(f"{path}: line {number} is not 'frame;frame;... COUNT': {line[:80]!r}")
            stacks.append((stack.split(";") if stack else [], int(count)))  # no frames: a sample py-spy could not read
    return stacks


def summary(stacks: list[tuple[list[str], int]], within: str = SERVING, top: int = 30) -> str:
    """Each frame's inclusive share of the samples whose stack holds `within` (counted once per stack), the
    frames every such sample holds left out, then the largest self shares."""
    kept = [(frames, n) for frames, n in stacks if any(within in f for f in frames)]
    total = sum(n for _, n in kept)
    if not total:
        return f"no sample holds a frame {within!r} ({sum(n for _, n in stacks)} samples in all)"
    inclusive, own = Counter(), Counter()
    for frames, n in kept:
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    lines = [f"{total} samples hold {within!r} ({sum(n for _, n in stacks)} in all); inclusive share:"]
    lines += [f"{100 * n / total:5.1f}%  {frame}" for frame, n in inclusive.most_common()
              if n < total][:top]
    lines.append("self share:")
    lines += [f"{100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(10)]
    return "\n".join(lines)


def engine_core_pid(interval: float = 0.5) -> int:
    """The busiest process titled as vLLM's engine core over `interval` seconds: the one serving, where another
    server sleeps beside it (the staged run's kept state, or a candidate's)."""
    def cpu_seconds() -> dict[int, float]:
        found = {}
        for proc in psutil.process_iter(["name", "cpu_times"]):
            if (proc.info["name"] or "").startswith(ENGINE_CORE) and proc.info["cpu_times"] is not None:
                found[proc.pid] = proc.info["cpu_times"].user + proc.info["cpu_times"].system
        return found
    before = cpu_seconds()
    if not before:
        raise SystemExit(f"no process titled {ENGINE_CORE!r}: is a vLLM server running?")
    time.sleep(interval)
    after = cpu_seconds()
    return max(after, key=lambda pid: (after[pid] - before.get(pid, after[pid]), pid))


def record(out: Path, seconds: int, py_spy: str) -> Path:
    tool = shutil.which(py_spy) or (py_spy if os.access(py_spy, os.X_OK) else None)
    if tool is None:
        raise SystemExit(f"no py-spy at {py_spy!r}: benchmarks/make_wheels.sh ships it in .whl")
    pid = engine_core_pid()
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "enginecore-profile.txt"
    done = subprocess.run([tool, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "200",
                           "--format", "raw", "--nonblocking", "--output", str(raw)],
                          capture_output=True, text=True, timeout=seconds + 60)
    if done.returncode != 0 or not raw.is_file():
        raw.unlink(missing_ok=True)  # a recording cut short is no recording
        raise SystemExit(f"py-spy record --pid {pid} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    packed = raw.with_suffix(".txt.gz")
    with open(raw, "rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return packed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="sample the busiest engine core into OUT/enginecore-profile.txt.gz")
    rec.add_argument("out", type=Path)
    rec.add_argument("--seconds", type=int, default=15)
    rec.add_argument("--py-spy", default="py-spy")
    summ = sub.add_parser("summary", help="a recording as each frame's share of the serving samples")
    summ.add_argument("raw", type=Path)
    summ.add_argument("--within", default=SERVING)
    summ.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    try:
        if args.command == "record":
            path = record(args.out, args.seconds, args.py_spy)
            print(f"{path}\n{summary(read_raw(path))}")
        else:
            print(summary(read_raw(args.raw), args.within, args.top))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
