"""Decision-quality benchmark: simulated probes with known true effects, judged by the stat and first rules.

Run ``python -m benchmarks.decisions`` (``--help`` for options). Every number comes from
the real ``Judge`` and ``first_rule``; numpy only draws the samples.

Probe model: sample = 100 x effect (candidate only) x drift(t) x (1 + cv * z), z standard normal,
t the sample's position in measurement order. Drift, when on, moves the probe's speed linearly by
5% (up or down, drawn per trial) from the first to the last sample of the rule's full budget:
2 x max_pairs samples for the stat judge (A B A B ... order), 2 x repeats for the first rule
(all baseline samples, then all candidate samples); ``--drift-span N`` gives both the same slope.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchestrator.decide import Judge, first_rule
from orchestrator.policy import Policy

DEFAULTS = Policy().model_dump()

EFFECTS = (-0.05, 0.0, 0.02, 0.05, 0.10, 0.50)
NOISES = (0.01, 0.03, 0.10)
DRIFT = 0.05


@dataclass
class Cell:
    effect: float
    cv: float
    drift: bool
    keep_rate: float
    mean_samples: float
    verdicts: dict[str, float]


def _draw(rng: np.random.Generator, trials: int, samples: int, cv: float, drift: bool,
          span: int | None = None) -> np.ndarray:
    """Noise times drift for ``samples`` measurements in time order, one row per trial; the drift's 5%
    accrues over ``span`` samples (default: all of them) and keeps its slope beyond."""
    noise = 1 + cv * rng.standard_normal((trials, samples))
    if not drift:
        return noise
    sign = rng.choice((-1.0, 1.0), size=(trials, 1))
    ramp = np.arange(samples)[None, :] / max(1, (span or samples) - 1)
    return noise * (1 + sign * DRIFT * ramp)


def run_stat(policy, effect: float, cv: float, drift: bool, trials: int, rng: np.random.Generator,
             span: int | None = None, order: str = "ab") -> Cell:
    """``order`` ab: every pair baseline first; abba: odd pairs candidate first (A B B A A B ...)."""
    judge = Judge(policy)
    n_max = judge.max_pairs
    series = 100.0 * _draw(rng, trials, 2 * n_max, cv, drift, span)
    first, second = series[:, 0::2], series[:, 1::2]
    swap = (np.arange(n_max) % 2 == 1) if order == "abba" else np.zeros(n_max, dtype=bool)
    base = np.where(swap, second, first)
    cand = np.where(swap, first, second) * (1 + effect)
    counts: dict[str, int] = {}
    kept = spent = 0
    for b_row, c_row in zip(base.tolist(), cand.tolist()):
        for n in range(1, n_max + 1):
            decision = judge.decide(b_row[:n], c_row[:n], final=n == n_max)
            if decision is not None:
                break
        counts[decision.verdict] = counts.get(decision.verdict, 0) + 1
        kept += judge.keeps(decision)
        spent += n
    return Cell(effect, cv, drift, kept / trials, spent / trials, {k: v / trials for k, v in counts.items()})


def run_first(repeats: int, min_gain: float, effect: float, cv: float, drift: bool, trials: int,
              rng: np.random.Generator, span: int | None = None) -> Cell:
    series = 100.0 * _draw(rng, trials, 2 * repeats, cv, drift, span)
    base, cand = series[:, :repeats], series[:, repeats:] * (1 + effect)
    counts: dict[str, int] = {}
    for b_row, c_row in zip(base.tolist(), cand.tolist()):
        verdict = first_rule(b_row, c_row, min_gain).verdict
        counts[verdict] = counts.get(verdict, 0) + 1
    return Cell(effect, cv, drift, counts.get("keep", 0) / trials, float(repeats),
                {k: v / trials for k, v in counts.items()})


def run_all(policy, trials: int, seed: int, span: int | None = None, order: str = "ab") -> list[tuple[Cell, Cell]]:
    rng = np.random.default_rng(seed)
    rows = []
    for cv in NOISES:
        for drift in (False, True):
            for effect in EFFECTS:
                stat = run_stat(policy, effect, cv, drift, trials, rng, span, order)
                first = run_first(policy.repeats, policy.min_gain, effect, cv, drift, trials, rng, span)
                rows.append((stat, first))
    return rows


def targets(rows: list[tuple[Cell, Cell]], min_pairs: int) -> list[tuple[str, bool, str]]:
    """The acceptance targets, all at 3% noise with drift."""
    cell = {(s.effect, s.cv, s.drift): s for s, _ in rows}
    at = lambda e: cell[(e, 0.03, True)]  # noqa: E731
    row = [s for s, _ in rows if s.cv == 0.03 and s.drift]
    mean_all = sum(s.mean_samples for s in row) / len(row)
    return [
        ("+10% kept >= 95%", at(0.10).keep_rate >= 0.95, f"{at(0.10).keep_rate:.1%}"),
        ("0% kept <= 5%", at(0.0).keep_rate <= 0.05, f"{at(0.0).keep_rate:.1%}"),
        ("-5% kept <= 1%", at(-0.05).keep_rate <= 0.01, f"{at(-0.05).keep_rate:.1%}"),
        ("mean samples per arm <= 6 (all six effects)", mean_all <= 6, f"{mean_all:.2f}"),
        ("mean samples per arm <= 6 (+10%)", at(0.10).mean_samples <= 6, f"{at(0.10).mean_samples:.2f}"),
        (f"+50% decided in min_pairs ({min_pairs})", at(0.50).mean_samples <= min_pairs,
         f"{at(0.50).mean_samples:.2f} pairs"),
    ]


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown(rows: list[tuple[Cell, Cell]], policy, trials: int, seed: int, seconds: float, command: str) -> str:
    lines = [
        "| noise CV | drift | true effect | stat: kept | stat: samples/arm | stat: verdicts "
        "| first: kept | first: samples/arm |",
        "|---:|:---:|---:|---:|---:|:---|---:|---:|",
    ]
    for stat, first in rows:
        verdicts = ", ".join(f"{k} {v:.1%}" for k, v in sorted(stat.verdicts.items()))
        lines.append(f"| {stat.cv:.0%} | {'±5%' if stat.drift else 'none'} | {stat.effect:+.0%} "
                     f"| {stat.keep_rate:.1%} | {stat.mean_samples:.2f} | {verdicts} "
                     f"| {first.keep_rate:.1%} | {first.mean_samples:.0f} |")
    checks = "\n".join(f"- {'PASS' if ok else 'MISS'} {name}: {value}"
                       for name, ok, value in targets(rows, policy.min_pairs))
    settings = ", ".join(f"{k}={getattr(policy, k)}" for k in
                         ("min_gain", "confidence", "min_pairs", "max_pairs", "implausible_factor", "repeats"))
    return (f"Command: `{command}`\n\n"
            f"Machine: {_cpu()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}, numpy {np.__version__}; {trials} trials per cell, seed {seed}, "
            f"{seconds:.0f} s wall.\n\nPolicy: {settings}.\n\nTargets (3% noise, drift):\n{checks}\n\n"
            + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decisions", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=7)
    for name in ("min_gain", "confidence", "implausible_factor"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=DEFAULTS[name])
    for name in ("min_pairs", "max_pairs", "repeats"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=DEFAULTS[name])
    parser.add_argument("--drift-span", type=int, default=None, metavar="N",
                        help="samples over which the 5%% drift accrues (default: each rule's whole budget)")
    parser.add_argument("--order", choices=("ab", "abba"), default="ab",
                        help="pair order of the stat judge: baseline always first, or alternating")
    parser.add_argument("--out", type=Path, help="also write the Markdown tables to this file")
    args = parser.parse_args(argv)
    chosen = {k: v for k, v in vars(args).items() if k in DEFAULTS}
    policy = Policy(**{**chosen, "rule": "stat", "interleave": True})
    command = "python -m benchmarks.decisions " + " ".join(argv if argv is not None else sys.argv[1:])
    start = time.perf_counter()
    rows = run_all(policy, args.trials, args.seed, args.drift_span, args.order)
    text = markdown(rows, policy, args.trials, args.seed, time.perf_counter() - start, command.strip())
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if all(ok for _, ok, _ in targets(rows, policy.min_pairs)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
