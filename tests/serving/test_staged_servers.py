"""The engine target staged by the real CLI with its default probes, one arm at a time (as on a GPU): one
engine server per state, shared by the serving samples of that state, and never alive beside another engine
server or the engine's correctness probe (which runs engines of its own). Instrumented by
device_guard/sitecustomize.py: each engine server and correctness probe holds one exclusive lock for its
whole life."""
from __future__ import annotations

import json
import os
from pathlib import Path

from serving_support import alive_with, query, stage_wider_batch

GUARD = Path(__file__).resolve().parent / "device_guard"

def test_one_engine_server_per_state_never_beside_another_engine(tmp_path):
    guard = tmp_path / "device.log"
    run = stage_wider_batch(tmp_path, "sequential", DEVICE_GUARD=str(guard),
                            PYTHONPATH=os.pathsep.join(filter(None, [str(GUARD), os.environ.get("PYTHONPATH")])))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    steps = {s["plugin"]: s for s in query(tmp_path, "SELECT * FROM steps")}
    assert steps["wider-batch"]["outcome"] == "kept", steps["wider-batch"]
    assert steps["(final)"]["outcome"] == "measured", steps["(final)"]
    # the baseline's two samples share one server; a candidate's pairs C B, B C cost three starts, the final
    # re-validation's too (it measures the deployment first); the correctness probes start none
    starts = query(tmp_path, "SELECT coalesce(s.plugin, 'baseline') AS plugin, p.what FROM processes p "
                             "LEFT JOIN steps s ON s.id = p.step_id WHERE p.what LIKE 'live server%' ORDER BY p.id")
    arms = ["live server (candidate)", "live server (baseline)", "live server (candidate)"]
    assert [(r["plugin"], r["what"]) for r in starts] == \
        [("baseline", "live server (baseline)"), *(("wider-batch", a) for a in arms), *(("(final)", a) for a in arms)]
    samples = query(tmp_path, "SELECT coalesce(s.plugin, 'baseline') AS plugin, m.arm, m.repeat, m.metrics "
                              "FROM measurements m LEFT JOIN steps s ON s.id = m.step_id "
                              "WHERE m.probe = 'serving' ORDER BY m.id")
    assert all(json.loads(m["metrics"])["pair"] == m["repeat"] for m in samples)
    assert [(m["arm"], m["repeat"]) for m in samples if m["plugin"] == "wider-batch"] == \
        [("candidate", 0), ("baseline", 0), ("baseline", 1), ("candidate", 1)]
    # the serving probe read each shared server's CPU time by its pid
    assert all(json.loads(m["metrics"])["cpu_score"] > 0 for m in samples)

    log = [line.split() for line in guard.read_text().splitlines()]
    assert [kind for kind, _, _ in log].count("server") == len(starts)
    assert [kind for kind, _, _ in log].count("correctness") == 2  # the baseline's and the candidate's
    assert [took for _, _, took in log] == ["alone"] * len(log), log
    assert alive_with(str(tmp_path)) == []
    assert query(tmp_path, "SELECT count(*) AS n FROM processes WHERE ended IS NULL")[0]["n"] == 0
