"""The screening benchmark's table (run.sh results): for each run's `status --json` in a folder, its wall time, the
screening's own figures, and its decision on every searched value, against the one-GPU run's (w1)."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def decisions(status: dict) -> dict[str, str]:
    """{value: outcome (reason)} of the search: a value's step on the target, else what its worker decided."""
    out: dict[str, str] = {}
    for step in sorted(status["steps"], key=lambda s: s.get("kind") == "screening"):
        if step["plugin"] == "batched-tokens-sweep" and step["params"]:
            value = str(step["params"]["max_num_batched_tokens"])
            out.setdefault(value, step["outcome"] + (f" ({step['reason']})" if step["reason"] else ""))
    return out


def main(folder: Path) -> None:
    runs = {p.stem.removeprefix("status-"): json.loads(p.read_text() or "null")
            for p in sorted(folder.glob("status-*.json"))}
    runs = {label: s for label, s in runs.items() if s}
    reference = decisions(runs["w1"]) if "w1" in runs else None
    print("| run | status | wall s | screening | decisions | same as w1 |")
    print("|---|---|---:|---|---|---|")
    for label, s in runs.items():
        run = s["run"]
        wall = (run["finished"] or 0) - run["started"] if run["finished"] else None
        screening = s.get("screening")
        screened = (f"{screening['candidates']} candidates on {screening['workers']} workers: "
                    f"{screening['seconds']:.0f} s with their staging, {screening['one_worker_seconds']:.0f} s "
                    f"on one worker in turn" if screening else "")
        found = decisions(s)
        same = "" if reference is None or label == "w1" else ("yes" if found == reference else "NO")
        shown = ", ".join(f"{v}: {d}" for v, d in sorted(found.items(), key=lambda x: int(x[0])))
        print(f"| {label} | {run['status']} | {'' if wall is None else f'{wall:.0f}'} | {screened} | {shown} | {same} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
