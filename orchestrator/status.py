"""What `status` shows: the 3.4 JSON document and the rich tables built from the same rows."""
from __future__ import annotations

from typing import Any

from rich.table import Table

from orchestrator.store import Store, loads


def status_data(store: Store, run_id: int | None = None) -> dict[str, Any] | None:
    run = store.run(run_id) if run_id is not None else store.run(command="run") or store.run(command=None)
    if run is None:
        return None
    steps = store.steps(run["id"])
    decisions = store.decisions_for(s["id"] for s in steps)
    out_steps = []
    for s in steps:
        d = decisions.get(s["id"])
        item = {"plugin": s["plugin"], "outcome": s["outcome"], "reason": s["reason"], "gain": s["gain"],
                "metrics": loads(s["metrics"]) or {}, "params": loads(s["params"]), "state": s["state"],
                "detail": s["detail"], "objective": s["objective"], "before": s["before_value"],
                "after": s["after_value"], "duration": s["duration"]}
        if d:
            item["decision"] = {k: d[k] for k in ("verdict", "rule", "ci_low", "ci_high", "n_baseline", "n_candidate",
                                                  "baseline_median", "candidate_median")}
            item["decision"]["vetoes"] = loads(d["vetoes"]) or []
        out_steps.append(item)
    return {"run": {"id": run["id"], "status": run["status"], "command": run["command"], "started": run["started"],
                    "finished": run["finished"], "detail": run["detail"]},
            "baseline": loads(run["baseline"]) or {}, "steps": out_steps}


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:.4g}"


def steps_table(data: dict[str, Any]) -> Table:
    run = data["run"]
    table = Table(title=f"run {run['id']} ({run['command']}): {run['status']}")
    table.add_column("plugin", overflow="fold")
    for col in ("outcome", "reason", "objective before → after", "gain", "duration"):
        table.add_column(col)
    style = {"kept": "green", "rolled_back": "red", "skipped": "yellow"}
    for s in data["steps"]:
        name = s["plugin"] + (" [" + ",".join(f"{k}={v}" for k, v in s["params"].items()) + "]" if s["params"] else "")
        outcome = s["outcome"] or s["state"]
        change = "" if s["before"] is None and s["after"] is None else f"{_num(s['before'])} → {_num(s['after'])}"
        table.add_row(name, f"[{style.get(outcome, 'cyan')}]{outcome}[/]", s["reason"] or "", change,
                      "" if s["gain"] is None else f"{s['gain']:+.2%}",
                      "" if s["duration"] is None else f"{s['duration']:.1f}s")
    return table


def runs_table(store: Store) -> Table:
    table = Table(title="runs")
    for col in ("id", "command", "status", "kept", "rolled back", "skipped", "detail"):
        table.add_column(col)
    for r in store.runs():
        table.add_row(str(r["id"]), r["command"], r["status"], str(r["kept"] or 0), str(r["rolled_back"] or 0),
                      str(r["skipped"] or 0), r["detail"] or "")
    return table
