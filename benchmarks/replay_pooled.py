"""Re-judges a finished run's recorded pairs twice: by its calibration alone, and by the between-start spread
pooled over the calibration and the decisions before each (noise.folded), as runs judge now.

    python -m benchmarks.replay_pooled state/orchestrator.db      # or a state folder's .tgz

Each line: a decision's verdict and interval both ways, and the pooled spread it was judged by. The calibration is
recomputed from the run's A/A steps (both servers fresh in each block, as a run's calibration starts them)."""
from __future__ import annotations

import argparse
import math
import sqlite3
import tarfile
import tempfile
from pathlib import Path

from orchestrator.decide import Judge
from orchestrator.noise import components, folded
from orchestrator.policy import Policy


def pairs_by_step(db: Path) -> list[tuple[str, list[tuple[float, int, float, int]]]]:
    """(step's plugin, [(baseline value, its server, candidate value, its server)]) of every measured step of the
    newest `run` in the history (an `orchestrator calibrate` after it has A/A steps of its own)."""
    conn = sqlite3.connect(db)
    try:
        [run] = conn.execute("SELECT max(id) FROM runs WHERE command = 'run'").fetchone()
        plugins = dict(conn.execute("SELECT id, plugin FROM steps WHERE run_id = ?", (run,)))
        pairs: dict[int, dict[int, dict[str, tuple[float, int]]]] = {}
        for step, arm, repeat, value, server in conn.execute(
                "SELECT step_id, arm, repeat, value, server FROM measurements WHERE role = 'throughput' AND ok = 1 "
                "AND arm IN ('baseline', 'candidate') AND run_id = ? AND step_id IS NOT NULL ORDER BY id", (run,)):
            pairs.setdefault(step, {}).setdefault(repeat, {})[arm] = (value, server)
    finally:
        conn.close()
    return [(plugins[step], [(*p["baseline"], *p["candidate"]) for _, p in sorted(reps.items()) if len(p) == 2])
            for step, reps in sorted(pairs.items())]


def replay(db: Path, policy: Policy) -> list[str]:
    steps = pairs_by_step(db)
    blocks = [[math.log(c / b) for b, _, c, _ in pairs] for plugin, pairs in steps if plugin.startswith("(A/A")]
    if len(blocks) < 2:
        raise SystemExit(f"{db}: the run has {len(blocks)} A/A steps; a replay needs its calibration's blocks")
    calibrated = noise = components(blocks, kept_restarted=True)
    fmt = lambda v: "n/a" if v is None else f"{v:+.1%}"  # noqa: E731
    lines = [f"calibration: within {calibrated.within:.2%}, between {calibrated.between:.2%} "
             f"({calibrated.between_df} df)"]
    for plugin, pairs in steps:
        if plugin.startswith("(A/A") or not pairs:
            continue
        base, cand = [p[0] for p in pairs], [p[2] for p in pairs]
        starts = [(p[1], p[3]) for p in pairs]
        alone = Judge(policy, calibrated).decide(base, cand, final=True, starts=starts)
        pooled = Judge(policy, noise).decide(base, cand, final=True, starts=starts)
        lines.append(f"{plugin:28s} calibration: {alone.verdict:12s} [{fmt(alone.ci_low)}, {fmt(alone.ci_high)}]"
                     f"  pooled: {pooled.verdict:12s} [{fmt(pooled.ci_low)}, {fmt(pooled.ci_high)}]"
                     f"  between {noise.between:.2%} ({noise.between_df} df)")
        if not plugin.startswith("("):  # the run folds its attempts, not its re-measurements
            noise = folded(noise, [math.log(c / b) for b, c in zip(base, cand)], starts)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("history", type=Path, help="orchestrator.db, or a state folder's .tgz holding state/")
    parser.add_argument("--min-gain", type=float, default=Policy().min_gain)
    args = parser.parse_args(argv)
    policy = Policy(rule="stat", min_gain=args.min_gain)
    if args.history.suffix in (".tgz", ".gz"):
        with tempfile.TemporaryDirectory() as tmp:
            with tarfile.open(args.history) as tar:
                tar.extractall(tmp, filter="data")
            found = sorted(Path(tmp).rglob("orchestrator.db"))
            if not found:
                raise SystemExit(f"{args.history}: no orchestrator.db inside")
            print("\n".join(replay(found[0], policy)))
    else:
        print("\n".join(replay(args.history, policy)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
