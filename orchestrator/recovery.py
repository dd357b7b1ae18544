"""Bringing the target back to the last kept state after a run died or was interrupted."""
from __future__ import annotations

from orchestrator.journal import Journal
from orchestrator.probes.marks import sweep_scope
from orchestrator.probes.runner import kill_group
from orchestrator.store import Store, label


def recover(store: Store, journal: Journal, run_status: str = "interrupted", detail: str | None = None) -> list[dict]:
    """Kill leftover processes (recorded, and any carrying this state folder's mark), restore every unfinished
    step newest first, close open runs.

    Call only while holding the state lock: then every open run is dead (or is the caller's own).
    Returns the steps it rolled back.
    """
    for proc in store.open_processes():
        kill_group(proc["pid"], proc["pgid"], proc["create_time"])
        store.end_process(proc["id"])
    sweep_scope(store.path.parent)  # also those started just before their row was written, and escaped ones
    rolled = []
    for step in store.open_steps():
        journal.restore(step["id"], exact=True)
        store.finish_step(step["id"], "rolled_back", "interrupted",
                          detail or f"the run stopped during {step['state']}; files restored")
        store.event(step["run_id"], "recovered", f"{label(step)}: restored pre-images", step["id"])
        rolled.append(step)
    for run in store.open_runs():
        store.finish_run(run["id"], run_status, detail)
    return rolled
