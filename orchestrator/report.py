"""A run's story for people: a Markdown report with a forest plot of its decisions.

Reads only the store (opened read-only, so it works while a run is going) and writes two files,
``run-<id>.md`` and ``run-<id>.png``; both are written to temporary names first and renamed
only once both exist, so a failure leaves the output folder as it was.
"""
from __future__ import annotations

import datetime as dt
import math
import os
import re
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from orchestrator import fingerprint as fp
from orchestrator.fingerprint import environment
from orchestrator.status import (first_window_line, offset_line, pooled_line, screening_line, screening_of, terms_line,
                                 wake_line)
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

    starts: list[float] = field(default_factory=list)  # seconds each live server started in it took to answer
    sampled: list[float] = field(default_factory=list)  # seconds of each throughput sample
    switched: list[float] = field(default_factory=list)  # seconds of each sleep or wake of a live server


SWITCHES = ("server_slept", "server_woken")  # the events of a sleeping pairing's switches (state_server.py)
SECONDS = re.compile(r" in ([0-9.]+) s$")  # how long one took, at the end of its message


def _objective_samples(rows: list[dict]) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}
    for row in rows:
        if row.get("role") == "throughput" and row.get("ok") and row.get("value") is not None:
            arm = (row.get("arm") or "?") + (f" on {row['worker']}" if row.get("worker") else "")
            samples.setdefault(arm, []).append(row["value"])
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
        servers = store.servers(run_id)
        calibration = store.calibration_of(run_id)
        screenings = store.screenings(run_id)
        switches = store.events(run_id, SWITCHES)
        stages, objective = [], None
        for step in steps:
            row = decisions.get(step["id"])
            measurements = store.measurements(step["id"], run_id)
            prints = [loads(m["fingerprint"]) for m in measurements if m.get("fingerprint")]
            stage = Stage(label(step) + (" (screened)" if step["kind"] == "screening" else ""), step["kind"], step["outcome"], step["reason"], step["detail"],
                          loads(step["params"]), step["duration"], samples=_objective_samples(measurements),
                          fingerprint=prints[-1] if prints else None,
                          starts=[p["ready"] - p["started"] for p in servers if p["step_id"] == step["id"]
                                  and p.get("ready")],
                          sampled=[m["duration"] for m in measurements if m["role"] == "throughput"
                                   and m["duration"] is not None],
                          switched=[float(found.group(1)) for e in switches if e["step_id"] == step["id"]
                                    and (found := SECONDS.search(e["message"] or ""))])
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
    if calibration is not None:
        run = {**run, "calibration": calibration}
    if screenings:
        run = {**run, "screening": screening_of(screenings)}
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


def _log_gain(g: float) -> float:
    return math.log1p(max(g, -0.99))


def chart(run: dict, baseline: dict[str, list[float]], stages: list[Stage], objective: str | None, path: Path) -> None:
    """A forest plot: each measured decision's gain with its interval, on a log-ratio axis (a halving and a
    doubling lie equally far from 0), the bar as a dashed line; kept in green, rolled back in red, re-measurements
    and A/A blocks in orange. One row a decision, sized to be read as it is."""
    rows = [s for s in stages if s.decision and s.decision.get("gain") is not None]
    height = 1.3 + 0.3 * max(1, len(rows))
    fig = Figure(figsize=(8.0, height), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours = {"kept": "tab:green", "rolled_back": "tab:red"}
    bars = set()
    span = [0.0, 0.0]
    for y, stage in enumerate(reversed(rows)):
        d = stage.decision
        colour = colours.get(stage.outcome or "", "tab:orange")
        x = _log_gain(d["gain"])
        low = _log_gain(d["ci_low"]) if d.get("ci_low") is not None else None
        high = _log_gain(d["ci_high"]) if d.get("ci_high") is not None else None
        if low is not None and high is not None:
            ax.hlines(y, low, high, color=colour, lw=2)
            span = [min(span[0], low), max(span[1], high)]
        ax.plot([x], [y], marker="o" if stage.outcome == "kept" else "D" if colour == "tab:orange" else "x",
                color=colour, ms=7, mew=2, label={"tab:green": "kept", "tab:red": "rolled back"}.get(colour, "measured"))
        span = [min(span[0], x), max(span[1], x)]
        if d.get("min_gain") is not None:
            bars.add(d["min_gain"])
    for bar in bars:
        ax.axvline(_log_gain(bar), color="0.3", ls="--", lw=1, label=f"bar {bar:+.0%}")
    ax.axvline(0, color="0.75", lw=1)
    labels = [s.plugin + (f" [{','.join(f'{k}={v}' for k, v in s.params.items())}]" if s.params else "")
              for s in reversed(rows)]
    ax.set_yticks(range(len(rows)), labels, fontsize=9)
    ax.set_ylim(-0.7, max(0.7, len(rows) - 0.3))
    low, high = span[0] - 0.05, span[1] + 0.05
    ax.set_xlim(low, high)
    ticks = [t for t in (-0.9, -0.5, -0.2, -0.1, -0.05, 0, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
             if low <= _log_gain(t) <= high]
    ax.set_xticks([_log_gain(t) for t in ticks], [f"{t:+.0%}" if t else "0" for t in ticks], fontsize=8)
    ax.set_xlabel(f"gain in {objective or 'the objective'} (log scale), with its interval")
    ax.set_title(f"Run {run['id']} ({run['status']}): each decision's gain", fontsize=10)
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    if unique:
        ax.legend(unique.values(), unique.keys(), fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")


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
    if (line := screening_line(run)) is not None:
        out.append(line[0].upper() + line[1:] + "; the samples below name the worker that measured each "
                   "(`candidate on w1`), and steps of kind `screening` are those a worker judged.")
    if (c := run.get("calibration")) is not None:
        summary = loads(c["summary"]) or {}
        sim = summary.get("simulated") or {}
        out += ["", "## Calibration (A/A)", "",
                f"{c['starts']} fresh servers of the state, {c['pairs']} pairs each against the kept state's "
                f"({c['pairing']}): the spread of log {c['objective']} is {c['within_sd']:.2%} within a server's life "
                f"and {c['between_sd']:.2%} between starts ({c['between_df']} degrees of freedom); a start takes "
                f"{_num(c['start_seconds'], '.1f')} s and a pair {_num(c['pair_seconds'], '.1f')} s.", "",
                f"- A/A decisions kept: {summary.get('aa_kept')} of {summary.get('aa_judged')}",
                f"- a change of no effect is kept in {sim.get('keep_rate_counting', 0):.1%} of simulated decisions "
                f"under this noise, {sim.get('keep_rate_ignoring', 0):.1%} by a judge that ignores the start effects",
                f"- pairs per start: {summary.get('pairs_per_start')}; to show a change of no effect below the bar: "
                f"{summary.get('pairs_needed') or 'over 100'} pairs on one pair of servers (sample noise only), "
                f"{summary.get('starts_needed') or 'over 100'} starts"]
        if summary.get("ceiling") is not None:
            out.append(f"- between starts at most {summary['ceiling']:.2%} at 90% confidence: a keep on one pair of "
                       "servers that start effects this large could explain is confirmed on fresh servers")
        if (line := offset_line(summary.get("fresh_offset"))) is not None:
            out.append(f"- {line}")
        if (line := pooled_line([s.decision for s in stages], c["between_df"])) is not None:
            out.append(f"- {line}")
        if (line := first_window_line(summary.get("first_window"))) is not None:
            out.append(f"- {line}")
        if wake := summary.get("wake"):
            out.append(f"- {wake_line(wake).strip()}")
        if (line := terms_line(summary.get("terms"))) is not None:
            out.append(f"- {line}")
    out += ["",
            f"![each decision's gain in {objective or 'the objective'}]({chart_name})", "",
            "Each row: a decision's gain with its interval (the A/A blocks of a calibration, too); the dashed line "
            "is the bar a gain must clear to be kept.", "",
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
            out.append(f"- took {s.duration:.1f} s" + (f": {len(s.starts)} server start(s), {sum(s.starts):.1f} s; "
                                                       + (f"{len(s.switched)} sleep(s) and wake(s), "
                                                          f"{sum(s.switched):.1f} s; " if s.switched else "")
                                                       + f"{len(s.sampled)} sample(s), {sum(s.sampled):.1f} s"
                                                       if s.starts or s.sampled else ""))
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
