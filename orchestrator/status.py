"""What `status` shows: the `status --json` document (docs/orchestrator.md, section 4) and the rich tables
built from it."""
from __future__ import annotations

from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table

from orchestrator.fingerprint import environment
from orchestrator.store import Reader, loads


def _stale(store: Reader, step: dict, current: dict[str, Any]) -> dict[str, Any]:
    """Whether a kept decision was measured in another environment (an already_applied step: its original's)."""
    from orchestrator.fingerprint import describe, is_stale
    recorded = store.fingerprint_of(step["id"])
    if recorded is None and step["reason"] == "already_applied":
        row = store.deployed().get(step["plugin"])
        recorded = store.fingerprint_of(row["step_id"]) if row else None
    if recorded is None:
        return {"stale": False}
    if not is_stale(recorded, current):
        return {"stale": False}
    return {"stale": True, "stale_because": describe(recorded, current)}


def alive(store: Reader, run: dict) -> bool:
    """Whether a run recorded as running still is: its process exists and is older than the run (not a reused
    pid); a process this machine cannot see (another pid namespace) counts while the state lock is held."""
    import psutil
    try:
        proc = psutil.Process(run["pid"])
        return proc.create_time() <= (run["started"] or 0) + 1 and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess, TypeError, ValueError):
        pass
    except psutil.Error:
        return True
    from orchestrator.lock import held
    return held(store.path.parent)


def shown(store: Reader, run: dict) -> dict:
    """The run as it is: a run recorded as running whose process is gone is shown interrupted, and why."""
    if run["status"] != "running" or alive(store, run):
        return run
    return {**run, "status": "interrupted",
            "detail": f"its process (pid {run['pid']}) is gone and nothing has recovered it yet: the next "
                      "`orchestrator recover`, `run` or `rollback` puts back what it left"}


def status_data(store: Reader, run_id: int | None = None) -> dict[str, Any] | None:
    run = store.run(run_id) if run_id is not None else store.run(command="run") or store.run(command=None)
    if run is None:
        return None
    run = shown(store, run)
    steps = store.steps(run["id"])
    decisions = store.decisions_for(s["id"] for s in steps)
    workers = store.workers_of(run["id"])
    current = environment() if any(s["outcome"] == "kept" for s in steps) else {}
    out_steps, final, attribution, blocks = [], None, [], []
    for s in steps:
        d = decisions.get(s["id"])
        item = {"plugin": s["plugin"], "outcome": s["outcome"], "reason": s["reason"], "gain": s["gain"],
                "metrics": loads(s["metrics"]) or {}, "params": loads(s["params"]), "state": s["state"],
                "detail": s["detail"], "objective": s["objective"], "before": s["before_value"],
                "after": s["after_value"], "duration": s["duration"], "control": loads(s["control"])}
        if d:
            item["decision"] = {k: d[k] for k in ("verdict", "rule", "ci_low", "ci_high", "n_baseline", "n_candidate",
                                                  "baseline_median", "candidate_median")}
            full = loads(d["decision"]) or {}
            item["decision"].update(starts=full.get("starts"), between=full.get("between"),
                                    between_df=full.get("between_df"),
                                    min_gain=full.get("min_gain"), notes=full.get("notes") or [])
            item["decision"]["vetoes"] = loads(d["vetoes"]) or []
        if s["kind"] == "screening":
            item["kind"] = "screening"
        if s["id"] in workers:
            item["workers"] = workers[s["id"]]
        if s["kind"] == "calibration":
            blocks.append(item)
        elif s["kind"] == "final":
            final = {**item, "better": bool(d) and d["verdict"] == "keep"}
        elif s["kind"] == "attribution":
            attribution.append(item)
        else:
            if s["outcome"] == "kept":
                item.update(_stale(store, s, current))
            out_steps.append(item)
    out = {"run": {"id": run["id"], "status": run["status"], "command": run["command"], "started": run["started"],
                   "finished": run["finished"], "detail": run["detail"]},
           "baseline": loads(run["baseline"]) or {}, "steps": out_steps}
    if final is not None:
        out["final"] = final
    if attribution:
        out["attribution"] = attribution
    if (calibration := calibration_of(store, run["id"], blocks)) is not None:
        out["calibration"] = calibration
    if screenings := store.screenings(run["id"]):
        out["screening"] = screening_of(screenings)
    return out


def screening_of(rows: list[dict]) -> dict[str, Any]:
    """A run's screenings on workers: how many candidates on how many workers, the seconds they took with the
    staging of what they found, the seconds one worker would have spent measuring them in turn, and the difference."""
    took = sum(r["finished"] - r["started"] for r in rows)
    alone = sum(r["busy"] or 0 for r in rows)
    return {"groups": len(rows), "candidates": sum(r["candidates"] for r in rows),
            "workers": max(r["workers"] for r in rows), "seconds": took, "one_worker_seconds": alone,
            "saved_seconds": alone - took}


def screening_line(data: dict[str, Any]) -> str | None:
    s = data.get("screening")
    if not s:
        return None
    return (f"screening: {s['candidates']} candidates in {s['groups']} group(s) on {s['workers']} workers took "
            f"{s['seconds']:.0f} s with the staging of what they found, against {s['one_worker_seconds']:.0f} s of "
            f"measuring them on one worker in turn: {s['saved_seconds']:.0f} s saved")


def calibration_of(store: Reader, run_id: int, blocks: list[dict]) -> dict[str, Any] | None:
    """The A/A calibration a run took (as its first step, or as `orchestrator calibrate`), with its blocks."""
    row = store.calibration_of(run_id)
    if row is None and not blocks:
        return None
    out: dict[str, Any] = {"blocks": blocks}
    if row is not None:
        out.update({k: row[k] for k in ("id", "objective", "pairing", "starts", "pairs", "between_df",
                                        "start_seconds", "pair_seconds")})
        out.update(within=row["within_sd"], between=row["between_sd"])
        out.update(loads(row["summary"]) or {})
    return out


def calibration_lines(data: dict[str, Any]) -> list[str]:
    """What an A/A calibration found, for people."""
    c = data.get("calibration")
    if not c:
        return []
    if c.get("within") is None:
        return [f"calibration: {len(c['blocks'])} A/A block(s) measured, not finished"]
    sim = c.get("simulated") or {}
    lines = [f"calibration ({c['starts']} starts x {c['pairs']} pairs, {c['pairing']}): spread of log "
             f"{c['objective']} within a start {c['within']:.2%}, between starts {c['between']:.2%}"
             + (f" (at most {c['ceiling']:.2%} at 90%: a keep on one pair of servers that start effects this "
                "large could explain is confirmed on fresh ones)" if c.get("ceiling") is not None else ""),
             f"  A/A decisions kept: {c.get('aa_kept', 0)} of {c.get('aa_judged', 0)}; a no-op kept in "
             f"{sim.get('keep_rate_counting', 0):.1%} of simulated decisions ({sim.get('keep_rate_ignoring', 0):.1%} "
             f"ignoring start effects); {c.get('pairs_per_start')} pairs per start; a no-op needs "
             f"{_or_more(c.get('pairs_needed'))} pairs on one pair of servers, {_or_more(c.get('starts_needed'))} "
             "starts, to show no gain"]
    if (line := offset_line(c.get("fresh_offset"))) is not None:
        lines.append(f"  {line}")
    decisions = [s.get("decision") for s in [*(data.get("steps") or []), data.get("final") or {}]]
    if (line := pooled_line(decisions, c.get("between_df"))) is not None:
        lines.append(f"  {line}")
    if (line := first_window_line(c.get("first_window"))) is not None:
        lines.append(f"  {line}")
    if wake := c.get("wake"):
        lines.append(wake_line(wake))
    if (line := terms_line(c.get("terms"))) is not None:
        lines.append(f"  {line}")
    return lines


def terms_line(terms: dict[str, float] | None) -> str | None:
    """Which of the serving score's terms its spread within a server comes from (noise.score_terms)."""
    if not terms:
        return None
    parts = [f"its {name} term {terms[name]:.2%}" for name in ("output", "input", "cached") if terms.get(name)]
    if not parts:
        return None
    streamed = (f"; counting each prompt over its streamed tokens instead (score_streamed), {terms['streamed']:.2%}"
                if terms.get("streamed") is not None else "")
    return (f"within a server the score spreads by {terms['score']:.2%} of its mean: " + ", ".join(parts)
            + f" (a prompt counts whole in the window its first token streams in){streamed}")


def pooled_line(decisions: list[dict[str, Any] | None], calibrated_df: int | None) -> str | None:
    """The spread between starts the run's latest decision counted, where the run had pooled its decisions on
    several blocks of servers into the calibration's (noise.folded)."""
    pooled = [d for d in decisions if d and d.get("between_df") and calibrated_df is not None
              and d["between_df"] > calibrated_df]
    if not pooled:
        return None
    last = pooled[-1]
    return (f"pooled with the run's decisions on several blocks of servers: between starts {last['between']:.2%} "
            f"({last['between_df']} degrees of freedom), as the latest decision counted it")


def offset_line(fresh: dict[str, Any] | None) -> str | None:
    """What fresh servers measured against the kept state's in the A/A blocks, which the judge takes for 0."""
    if not fresh or fresh.get("low") is None:
        return None
    line = f"fresh servers against the kept one: {fresh['mean']:+.2%} [{fresh['low']:+.2%}, {fresh['high']:+.2%}]"
    if fresh.get("keep_rate") is None:
        return line + ", consistent with no offset"
    return line + f"; a change of no effect with that offset is kept in {fresh['keep_rate']:.0%} of simulated decisions"


def first_window_line(first: dict[str, Any] | None) -> str | None:
    """What a fresh server's first sample measured against its next (noise.first_window)."""
    if not first:
        return None
    line = (f"a fresh server's first sample against its next: {first['mean']:+.2%} [{first['low']:+.2%}, "
            f"{first['high']:+.2%}] ({first['servers']} servers)")
    if first["low"] > 0 or first["high"] < 0:
        return line + ": the warm-up did NOT warm them; differences from a first sample count for no wake"
    return line + ", consistent with a warm server"


def wake_line(wake: dict[str, Any]) -> str:
    """What the calibration of a sleeping pairing found a wake to do to a server."""
    if wake.get("spread") is None:
        return "  a wake: too few samples to tell what it changes; woken servers are trusted"
    seconds = f" (a sleep or wake takes {wake['switch_seconds']:.1f} s)" if wake.get("switch_seconds") else ""
    verdict = ("woken servers measure like the servers they were" if wake.get("like_fresh") else
               "woken servers do NOT measure like the servers they were: runs restart servers instead")
    still = f", {wake['still']:.2%} from one sample to the next without one" if wake.get("still") is not None else ""
    return (f"  a wake moves a server by {wake['spread']:.2%} RMS (p = {wake.get('p', 1):.3f}; {wake.get('woken')} "
            f"differences across a wake, {wake.get('same')} within one{still}){seconds}: {verdict}")


def _or_more(n: int | None) -> str:
    return "over 100" if n is None else str(n)


def _interval(item: dict[str, Any]) -> str:
    d = item.get("decision") or {}
    if d.get("ci_low") is None or d.get("ci_high") is None:
        return ""
    return f" [{d['ci_low']:+.2%}, {d['ci_high']:+.2%}] over {d['n_baseline']}/{d['n_candidate']} samples"


def revalidation_lines(data: dict[str, Any]) -> list[str]:
    """Rich-markup lines for the final re-validation and the contributions; a stack that is not better is loud."""
    lines = []
    final = data.get("final")
    if final is not None:
        gain = "" if final["gain"] is None else f"gain {final['gain']:+.2%}"
        if final.get("decision") is None:
            lines.append(f"final re-validation: {escape(final['outcome'] or 'in progress')} "
                         f"{escape(final['reason'] or '')} {escape(final['detail'] or '')}".rstrip())
        elif final["better"]:
            lines.append(f"[green]final re-validation[/]: the kept stack beats the run's baseline, {gain}"
                         f"{escape(_interval(final))}")
        else:
            lines.append(f"[bold red]WARNING: the kept stack as a whole is NOT better than the run's baseline[/] "
                         f"({escape(final['reason'] or '')}: {escape(final['detail'] or '')}); nothing was rolled "
                         "back: inspect the contributions (`run --attribute`) and roll back by hand")
    for item in data.get("attribution", []):
        if item["reason"] == "not_separable":
            lines.append(f"contribution of {escape(item['plugin'])}: not separable ({escape(item['detail'] or '')})")
        elif item["gain"] is None:
            lines.append(f"contribution of {escape(item['plugin'])}: not measured ({escape(item['detail'] or '')})")
        else:
            lines.append(f"contribution of {escape(item['plugin'])}: {item['gain']:+.2%}{escape(_interval(item))}")
    return lines


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:.4g}"


OUTCOMES = {"kept": "kept", "rolled_back": "back", "skipped": "skip", "measured": "meas"}


def _gain(s: dict[str, Any]) -> str:
    """The gain with its interval, short: `+81.0% [+26, +159]`."""
    if s["gain"] is None:
        return ""
    d = s.get("decision") or {}
    if d.get("ci_low") is None or d.get("ci_high") is None:
        return f"{s['gain']:+.1%}"
    return f"{s['gain']:+.1%} [{100 * d['ci_low']:+.0f}, {100 * d['ci_high']:+.0f}]"


def steps_table(data: dict[str, Any]) -> Table:
    """One row a step, readable in 80 columns: ids whole, the other columns short (outcome kept / back / skip,
    the gain with its interval in percent, the pairs judged, the seconds taken); reasons wrap."""
    run = data["run"]
    table = Table(title=f"run {run['id']} ({run['command']}): {run['status']}", box=box.SIMPLE_HEAD,
                  padding=(0, 1), pad_edge=False, title_justify="left")
    table.add_column("plugin", no_wrap=True)
    table.add_column("", no_wrap=True)
    table.add_column("reason", overflow="fold", ratio=1)
    table.add_column("gain [95% CI]", overflow="fold")
    table.add_column("n", justify="right", no_wrap=True)
    table.add_column("s", justify="right", no_wrap=True)
    stale = any(s.get("stale") for s in data["steps"])
    controls = any(s.get("control") for s in data["steps"])
    workers = any(s.get("workers") for s in data["steps"])
    if workers:
        table.add_column("worker", overflow="fold")
    if stale:
        table.add_column("stale", overflow="fold")
    if controls:
        table.add_column("control", overflow="fold")
    style = {"kept": "green", "rolled_back": "red", "skipped": "yellow"}
    for s in data["steps"]:
        name = escape(s["plugin"])
        if s["params"]:
            name += "\n [dim]" + escape(",".join(f"{k}={v}" for k, v in s["params"].items())) + "[/]"
        outcome = s["outcome"] or s["state"]
        d = s.get("decision") or {}
        pairs = "" if d.get("n_candidate") is None or d.get("rule") == "configuration" else str(d["n_candidate"])
        row = [name, f"[{style.get(outcome, 'cyan')}]{OUTCOMES.get(outcome, outcome)}[/]", escape(s["reason"] or ""),
               _gain(s), pairs, "" if s["duration"] is None else f"{s['duration']:.0f}"]
        if workers:
            row.append(escape(", ".join(s.get("workers", []))))
        if stale:
            row.append(f"[yellow]stale: {escape(s['stale_because'])}[/]" if s.get("stale") else "")
        if controls:
            row.append(_control(s.get("control")))
        table.add_row(*row)
    return table


def _control(control: dict | None) -> str:
    """The probe a failed candidate was re-checked with on the last kept state, and how that went."""
    if not control:
        return ""
    if control["passed"]:
        return f"[green]{escape(control['probe'])} passed[/]"
    return f"[red]{escape(control['probe'])} failed: {escape(control['reason'] or '')}[/]"


def runs_table(store: Reader) -> Table:
    table = Table(title="runs")
    for col in ("id", "command", "status", "kept", "rolled back", "skipped", "detail"):
        table.add_column(col)
    for r in (shown(store, r) for r in store.runs()):
        table.add_row(str(r["id"]), r["command"], r["status"], str(r["kept"] or 0), str(r["rolled_back"] or 0),
                      str(r["skipped"] or 0), escape(r["detail"] or ""))
    return table
