"""The latest serving samples of a staged run, one line each, read from its history (read-only): which server gave
each, its score and output rate, the TPOT (and vLLM's own inter-token latency and iterations, the client's share of
a core, the card's power and clock, where recorded), and the warm-up before a fresh server's first window (its seconds, each
step's output rate, whether it settled). `run.sh status` prints them, so that a run on the GPU shows as it goes
whether fresh servers' first windows measure like the later ones. Then each configuration reading (the `vllm-config`
probe's) against the baseline's: the same, or the keys it differs in, so that a run shows which changes its
servers resolved away and whether anything that differs between starts is left in the readings.

    python benchmarks/vllm_h200/samples.py STATE/orchestrator.db [N]
"""
from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path


def lines(db: Path, n: int = 8) -> list[str]:
    con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    rows = con.execute("SELECT step_id, arm, repeat, server, value, metrics FROM measurements WHERE role = 'throughput'"
                       " AND ok = 1 ORDER BY id DESC LIMIT ?", (n,)).fetchall()
    out = []
    for step, arm, repeat, server, value, metrics in reversed(rows):
        m = json.loads(metrics or "{}")
        line = (f"step {step if step is not None else '-'} {arm} #{repeat + 1} server {server}: score {value:,.0f}, "
                f"{m.get('output_throughput', 0):,.0f} out tok/s, TPOT {m.get('mean_tpot_ms', 0):.1f} ms")
        if "server_itl_ms" in m:  # vLLM's own view: a slow window the server's, or the client's
            line += (f" (server: ITL {m['server_itl_ms']:.1f} ms, {m.get('server_iterations', 0):,} iterations of "
                     f"{m.get('server_iteration_ms', 0):.1f} ms, {m.get('server_preemptions', 0)} preempted)")
        if "client_busy" in m:
            line += f"; client {m['client_busy']:.0%} of a core"
        gpus = [g for g in m.get("gpus") or [] if isinstance(g, dict) and "power_w" in g]
        if gpus:  # the card's draw after the window: a slow window at full clocks and low power waited on the host
            line += "; GPU " + ", ".join(f"{g['power_w']:.0f} W {g.get('sm_mhz', 0):,.0f} MHz" for g in gpus)
        if "warmup_seconds" in m:
            rates = " ".join(f"{r:,.0f}" for r in m.get("warmup_rates", []))
            settled = {True: ", settled", False: ", NOT settled"}.get(m.get("warmup_settled"), "")
            line += f"; warm-up {m['warmup_seconds']:.1f} s{f' (rates {rates})' if rates else ''}{settled}"
        out.append(line)
    return out


def flat(reading: dict) -> dict:
    """A configuration probe's reading as {section.key: value} (the engine's keys are dotted already)."""
    return {f"{section}.{k}" if k else section: x for section, v in reading.items()
            for k, x in (v.items() if isinstance(v, dict) else [("", v)])}


def unread(where: str, arm: str, metrics: dict) -> str:
    """A configuration measurement with no reading (the history cut it to its numbers), by the keys it kept."""
    return f"configuration {where} {arm}: no reading ({', '.join(sorted(metrics)) or 'empty'})"


def configurations(db: Path) -> list[str]:
    """One line per configuration reading after the baseline's: the baseline's, or the keys it differs in."""
    con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    rows = con.execute("SELECT step_id, arm, metrics FROM measurements WHERE role = 'configuration' AND ok = 1 "
                       "ORDER BY id").fetchall()
    rows = [(step, arm, json.loads(m)) for step, arm, m in rows]
    base = next((flat(m["configuration"]) for step, arm, m in rows if step is None and "configuration" in m), None)
    if base is None:
        return [unread("baseline", arm, m) for step, arm, m in rows if step is None]
    out = []
    for step, arm, metrics in rows:
        if step is None:
            continue
        if "configuration" not in metrics:
            out.append(unread(f"step {step}", arm, metrics))
            continue
        mine = flat(metrics["configuration"])
        changed = sorted(k for k in base.keys() | mine.keys() if base.get(k) != mine.get(k))
        shown = ", ".join(f"{k} {base.get(k)!r} -> {mine.get(k)!r}" for k in changed[:4])
        out.append(f"configuration step {step} {arm}: " + (f"differs in {len(changed)}: {shown}"
                                                            + (", ..." if len(changed) > 4 else "")
                                                            if changed else "the baseline's"))
    return out


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or not Path(sys.argv[1]).is_file():
        sys.exit("usage: samples.py STATE/orchestrator.db [N]")
    print("\n".join(lines(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) == 3 else 8)
                    + configurations(Path(sys.argv[1]))))
