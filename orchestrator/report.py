"""A run's story for people: a Markdown report with a chart of the objective at each stage.

Reads only the store (opened read-only, so it works while a run is going) and writes two files,
``run-<id>.md`` and ``run-<id>.png``; both are written to temporary names first and renamed
only once both exist, so a failure leaves the output folder as it was.
"""
from __future__ import annotations

import datetime as dt
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from orchestrator import fingerprint as fp
from orchestrator.fingerprint import environment
from orchestrator.store import Reader, label, loads


class ReportError(LookupError):
    """The database or run asked for does not exist."""


@dataclass
class Stage:
    """One step (a plugin attempt, or a re-measurement of the kept stack) as the report shows it."""
    plugin: str  # its label: the plugin id, "(final)" or "(without ID)"
    kind: str
    outcome: str | None
    reason: str | None
    detail: str | None
    params: Any
    duration: float | None
    decision: dict | None = None
    vetoes: list[str] = field(default_factory=list)
    policy: dict | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)
    fingerprint: dict | None = None

    @property
    def level(self) -> tuple[float, float | None, float | None] | None:
        """Candidate objective with its interval, in objective units: the baseline median scaled by the effect."""
        d = self.decision
        if not d or d.get("baseline_median") is None:
            return None
        base = d["baseline_median"]
        if d.get("gain") is None:
            return (d.get("candidate_median"), None, None) if d.get("candidate_median") is not None else None
        low, high = d.get("ci_low"), d.get("ci_high")
        return (base * (1 + d["gain"]), None if low is None else base * (1 + low),
                None if high is None else base * (1 + high))


def _objective_samples(rows: list[dict]) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}
    for row in rows:
        if row.get("role") == "throughput" and row.get("ok") and row.get("value") is not None:
            samples.setdefault(row.get("arm") or "?", []).append(row["value"])
    return samples


def load(db_path: Path, run_id: int) -> tuple[dict, dict[str, list[float]], list[Stage], str | None]:
    """The run row, the run-level baseline samples, the stages and the objective's name."""
    if not Path(db_path).is_file():
        raise ReportError(f"{db_path}: no such database")
    store = Reader(Path(db_path))
    try:
        run = store.run(run_id)
        if run is None:
            raise ReportError(f"{db_path}: no run with id {run_id}")
        steps = store.steps(run_id)
        decisions = store.decisions_for(s["id"] for s in steps)
        stages, objective = [], None
        for step in steps:
            row = decisions.get(step["id"])
            measurements = store.measurements(step["id"], run_id)
            prints = [loads(m["fingerprint"]) for m in measurements if m.get("fingerprint")]
            stage = Stage(label(step), step["kind"], step["outcome"], step["reason"], step["detail"],
                          loads(step["params"]), step["duration"], samples=_objective_samples(measurements),
                          fingerprint=prints[-1] if prints else None)
            if row is not None:
                stage.decision = loads(row["decision"]) or {k: row[k] for k in row}
                stage.vetoes = loads(row["vetoes"]) or []
                stage.policy = loads(row["policy"])
                objective = objective or row["objective"]
            objective = objective or step.get("objective")
            stages.append(stage)
        baseline = _objective_samples(store.measurements(None, run_id))
    finally:
        store.close()
    return run, baseline, stages, objective


def _baseline_value(run: dict, baseline: dict[str, list[float]], stages: list[Stage], objective: str | None):
    values = [v for arm in baseline.values() for v in arm]
    if values:
        return statistics.median(values), min(values), max(values)
    recorded = loads(run.get("baseline"))
    if isinstance(recorded, dict) and isinstance(recorded.get(objective), (int, float)):
        return float(recorded[objective]), None, None
    for stage in stages:
        if stage.decision and stage.decision.get("baseline_median") is not None:
            return stage.decision["baseline_median"], None, None
    return None


def chart(run: dict, baseline: dict[str, list[float]], stages: list[Stage], objective: str | None, path: Path) -> None:
    """Baseline, then each measured stage: kept in green on the deployment's line, rolled back in red off it."""
    fig = Figure(figsize=(max(6.0, 1.1 * (len(stages) + 2)), 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels, line_x, line_y = [], [], []
    base = _baseline_value(run, baseline, stages, objective)
    if base is not None:
        value, low, high = base
        _point(ax, 0, value, low, high, "tab:blue", "o", "baseline")
        line_x.append(0)
        line_y.append(value)
    labels.append("baseline")
    x = 0
    for stage in stages:
        level = stage.level
        if level is None:
            continue
        x += 1
        value, low, high = level
        if stage.outcome == "kept":
            labels.append(stage.plugin)
            _point(ax, x, value, low, high, "tab:green", "o", "kept")
            line_x.append(x)
            line_y.append(value)
        elif stage.outcome == "rolled_back":
            labels.append(f"{stage.plugin}\n({stage.reason})")
            _point(ax, x, value, low, high, "tab:red", "x", "rolled back")
        else:  # measured but not (yet) an outcome: a run in progress, or a re-validation of the stack
            labels.append(f"{stage.plugin}\n({stage.outcome or 'unfinished'})")
            _point(ax, x, value, low, high, "tab:orange", "D", "measured")
    if line_x:
        ax.step(line_x + [x], line_y + [line_y[-1]], where="post", color="0.6", lw=1, zorder=0, label="deployed")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(objective or "objective")
    ax.set_title(f"Run {run['id']}: {objective or 'objective'} at each stage ({run['status']})")
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    if unique:
        ax.legend(unique.values(), unique.keys(), fontsize=8, loc="best")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")


def _point(ax, x, value, low, high, color, marker, label):
    err = None
    if low is not None and high is not None:
        err = [[max(0.0, value - low)], [max(0.0, high - value)]]
    ax.errorbar([x], [value], yerr=err, fmt=marker, color=color, capsize=4, ms=7, label=label)


def _num(value: Any, fmt: str = ".4g") -> str:
    return "" if value is None else format(value, fmt)


def _pct(value: Any) -> str:
    return "" if value is None else f"{value:+.1%}"


def _cell(text: Any) -> str:
    return "" if text is None else str(text).replace("|", "\\|").replace("\n", " ")


def _when(ts: float | None) -> str:
    return "" if ts is None else dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def markdown(run: dict, baseline: dict[str, list[float]], stages: list[Stage], objective: str | None,
             chart_name: str) -> str:
    out = [f"# Run {run['id']}: {run['status']}", ""]
    out += [f"- command: `{run.get('command')}`", f"- target: {run.get('target_kind') or ''}",
            f"- started: {_when(run.get('started'))}", f"- finished: {_when(run.get('finished'))}",
            f"- objective: {objective or 'none measured'}"]
    base = _baseline_value(run, baseline, stages, objective)
    if base is not None:
        samples = [v for arm in baseline.values() for v in arm]
        out.append(f"- baseline: {_num(base[0])}" + (f" (median of {len(samples)} samples)" if samples else ""))
    if run.get("detail"):
        out.append(f"- detail: {run['detail']}")
    measured = next((s.fingerprint for s in stages if s.fingerprint), None)
    if measured:
        out.append("- environment: " + ", ".join(f"{k} {measured.get(k)}" for k in fp.STALE_KEYS
                                                  if measured.get(k) is not None))
    counts = {k: sum(s.outcome == k for s in stages) for k in ("kept", "rolled_back", "skipped")}
    out += ["", f"Kept {counts['kept']}, rolled back {counts['rolled_back']}, skipped {counts['skipped']}."]
    final = next((s for s in stages if s.kind == "final" and s.decision), None)
    if final is not None:
        verdict = "beats" if final.decision.get("verdict") == "keep" else "is NOT better than"
        out.append(f"Final re-validation: the kept stack as a whole {verdict} the run's baseline "
                   f"({_pct(final.decision.get('gain'))}); rows `(without X)` give each plugin's contribution.")
    out += ["",
            f"![{objective or 'objective'} at each stage]({chart_name})", "",
            "Bars: each candidate's confidence interval (the baseline's: the range of its samples); "
            "the grey line is the deployed objective.", "",
            "| plugin | outcome | reason | gain | interval | samples (base/cand) | baseline | candidate | rule |",
            "|---|---|---|---:|---|---:|---:|---:|---|"]
    for s in stages:
        d = s.decision or {}
        interval = f"{_pct(d.get('ci_low'))} … {_pct(d.get('ci_high'))}" if d.get("ci_low") is not None else ""
        n = f"{d['n_baseline']}/{d['n_candidate']}" if d.get("n_baseline") is not None else ""
        out.append(f"| {_cell(s.plugin)} | {s.outcome or 'unfinished'} | {s.reason or ''} | {_pct(d.get('gain'))} "
                   f"| {interval} | {n} | {_num(d.get('baseline_median'))} | {_num(d.get('candidate_median'))} "
                   f"| {d.get('rule') or ''} |")
    current = environment()
    for s in stages:
        out += ["", f"## {s.plugin}", "", f"- outcome: {s.outcome or 'unfinished'}"
                + (f", reason: {s.reason}" if s.reason else "")]
        if s.params:
            out.append(f"- params: `{s.params}`")
        if s.detail:
            out.append(f"- detail: {_cell(s.detail)}")
        d = s.decision
        if d:
            line = f"- verdict: {d.get('verdict')}, gain {_pct(d.get('gain'))}"
            if d.get("ci_low") is not None:
                conf = f"{d['confidence']:.0%} " if d.get("confidence") else ""
                line += f", {conf}interval {_pct(d['ci_low'])} … {_pct(d.get('ci_high'))}"
            if d.get("min_gain") is not None:
                line += f", bar {_pct(d['min_gain'])}"
            out.append(line)
            out.extend(f"- note: {note}" for note in d.get("notes") or [])
        out.extend(f"- guardrail veto: {v}" for v in s.vetoes)
        for arm, values in sorted(s.samples.items()):
            out.append(f"- {arm} samples: " + ", ".join(_num(v) for v in values))
        if s.duration is not None:
            out.append(f"- took {s.duration:.1f} s")
        if s.outcome == "kept" and s.fingerprint is not None and fp.is_stale(s.fingerprint, current):
            out.append(f"- stale: measured under another environment ({fp.describe(s.fingerprint, current)})")
    return "\n".join(out) + "\n"


def write_report(db_path: Path, run_id: int, out_dir: Path) -> Path:
    """Write ``run-<id>.md`` and its chart ``run-<id>.png`` into ``out_dir``; return the Markdown path."""
    run, baseline, stages, objective = load(Path(db_path), run_id)
    out_dir = Path(out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, png_path = out_dir / f"run-{run_id}.md", out_dir / f"run-{run_id}.png"
    temps: list[Path] = []
    done = False
    try:
        for suffix in (".png", ".md"):
            fd, name = tempfile.mkstemp(prefix=f".run-{run_id}-", suffix=suffix, dir=out_dir)
            os.close(fd)
            temps.append(Path(name))
        chart(run, baseline, stages, objective, temps[0])
        temps[1].write_text(markdown(run, baseline, stages, objective, png_path.name))
        os.replace(temps[0], png_path)
        os.replace(temps[1], md_path)
        done = True
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)
        if created and not done:
            out_dir.rmdir()
    return md_path
