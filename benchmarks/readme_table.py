"""Fills a per-plugin column of README.md ("measured on the GPU engine" unless `--column` names another) from
a run's `orchestrator status --json`.

    python -m benchmarks.readme_table benchmarks/h200-main-job/status-2026-12-03.json [--readme README.md]
    python -m benchmarks.readme_table benchmarks/cpu-main-job/status.json --column "decided on the CPU"

Each cell is that run's decision for the plugin: outcome, reason, gain with its interval and the pairs
measured, so that the table is what the orchestrator decided, never typed by hand.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

COLUMN = "measured on the GPU engine"


def pct(value: float | None) -> str:
    return "–" if value is None else f"{value:+.1%}"


def cell(step: dict) -> str:
    outcome, reason, decision = step["outcome"], step.get("reason"), step.get("decision") or {}
    if outcome == "skipped":
        return f"skipped: {reason}"
    if (step.get("detail") or "").startswith("runs what "):
        return f"rolled back: {reason}, unmeasured: the same change as `{step['detail'].split()[2]}`"
    if decision.get("rule") == "configuration":
        return f"rolled back: {reason}, unmeasured: runs what the kept state runs"
    if not decision or decision.get("n_candidate") is None:
        return f"{outcome.replace('_', ' ')}: {reason}" if reason else outcome.replace("_", " ")
    interval = ""
    if decision.get("ci_low") is not None and decision.get("ci_high") is not None:
        interval = f" [{pct(decision['ci_low'])}, {pct(decision['ci_high'])}]"
    head = "kept" if outcome == "kept" else f"rolled back: {reason}"
    return f"{head}, {pct(step.get('gain'))}{interval}, {decision['n_candidate']} pairs"


def decisions(status: dict) -> dict[str, str]:
    """The last attempt of each plugin in the run (a plugin with params has one step per candidate); a step
    still being measured (no outcome yet) leaves its cell as it is."""
    cells: dict[str, str] = {}
    for step in status["steps"]:
        if step.get("kind", "attempt") == "attempt" and step.get("outcome"):
            cells[step["plugin"]] = cell(step)
    return cells


def fill(readme: str, cells: dict[str, str], column: str = COLUMN) -> str:
    lines = readme.splitlines(keepends=True)
    header = next(i for i, ln in enumerate(lines) if ln.startswith("|") and column in ln)
    index = [c.strip() for c in lines[header].strip().strip("|").split("|")].index(column)
    for i in range(header + 2, len(lines)):
        if not lines[i].startswith("|"):
            break
        parts = lines[i].rstrip("\n").strip().strip("|").split("|")
        plugin = re.sub(r"[`\s]", "", parts[0])
        if plugin in cells:
            parts[index] = f" {cells[plugin]} "
            lines[i] = "|" + "|".join(parts) + "|\n"
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readme_table", description=__doc__.splitlines()[0])
    p.add_argument("status", type=Path)
    p.add_argument("--readme", type=Path, default=Path("README.md"))
    p.add_argument("--column", default=COLUMN, help=f"the column's header (default: {COLUMN!r})")
    args = p.parse_args(argv)
    cells = decisions(json.loads(args.status.read_text()))
    args.readme.write_text(fill(args.readme.read_text(), cells, args.column))
    print(f"{len(cells)} plugins filled in {args.readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
