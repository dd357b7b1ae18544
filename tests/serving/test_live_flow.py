"""The GPU run's flow on a CPU, through the real CLI: the baseline's live server is the kept state's and serves an
A/A calibration first; each candidate's own server answers its live correctness probe (greedy outputs by agreement
with the baseline server's, and kernels.check of the kernels it reports) and its steady-state samples, beside the
kept state's; a wrong candidate's control re-check asks the kept state's live server."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from serving_support import PY, alive_with, env, query

CONFIG = """\
target:
  kind: engine
  workspace: ws
  device: cpu
  num_layers: 1
  kernel_checks: small
  objective: cpu_score
  arms: coresident
  correctness: live
  workload: {num_prompts: 8, input_len: 32, output_len: 16, max_concurrency: 8, duration: 1.5, ramp: 0.5}
plugins: plugins
state: state
policy: {min_pairs: 2, max_pairs: 3, pairs_per_start: 3, max_starts: 1, repeats: 1, min_gain: 0.02, calibrate: {starts: 3, pairs: 2}}
"""
PLUGINS = {
    # eight sequences a step instead of one: a gain of several times, declared so
    "wider-batch": "accept: {implausible_factor: 10}\napply:\n  - yaml_set: {path: \"${serve_config}\", key: max-num-seqs, "
                   "value: 8}\n    root: serve\n",
    "other-weights": "apply:\n  - yaml_set: {path: \"${serve_config}\", key: seed, value: 7}\n    root: serve\n",
}


def stage(folder: Path, config: str = CONFIG) -> None:
    """`orchestrator run` of `config` with PLUGINS in `folder`; it must succeed."""
    (folder / "orchestrator.yaml").write_text(config)
    for order, (plugin, body) in enumerate(PLUGINS.items()):
        (folder / "plugins" / plugin).mkdir(parents=True)
        (folder / "plugins" / plugin / "plugin.yaml").write_text(
            f"id: {plugin}\norder: {order}\ntargets: [engine]\n{body}")
    run = subprocess.run([PY, "-m", "orchestrator.cli", "run", "--config", "orchestrator.yaml"], cwd=folder,
                         env=env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_the_gpu_flow_runs_on_live_servers_from_calibration_to_the_final_revalidation(tmp_path):
    stage(tmp_path)
    steps = {s["plugin"]: s for s in query(tmp_path, "SELECT * FROM steps")}
    assert steps["wider-batch"]["outcome"] == "kept", steps["wider-batch"]
    wrong = steps["other-weights"]
    assert (wrong["outcome"], wrong["reason"]) == ("rolled_back", "incorrect"), wrong
    assert "diverge from the baseline" in wrong["detail"] and json.loads(wrong["control"])["passed"]
    assert steps["(final)"]["outcome"] == "measured"
    [calibration] = query(tmp_path, "SELECT * FROM calibrations")
    assert (calibration["starts"], calibration["pairs"], calibration["pairing"]) == (3, 2, "coresident")
    assert [steps[f"(A/A {i})"]["kind"] for i in (1, 2, 3)] == ["calibration"] * 3
    # which of the score's terms its spread within a server comes from, from the A/A samples' metrics
    terms = json.loads(calibration["summary"])["terms"]
    assert terms["output"] > 0 and terms["input"] > 0
    assert terms["score"] <= terms["output"] + terms["input"] + terms["cached"] + 1e-12

    procs = query(tmp_path, "SELECT p.id, coalesce(s.plugin, 'baseline') AS plugin, p.what, p.started, p.ended "
                            "FROM processes p LEFT JOIN steps s ON s.id = p.step_id ORDER BY p.id")
    servers = [p for p in procs if p["what"].startswith("live server")]
    kept = servers[0]
    assert kept["plugin"] == "baseline"
    # the baseline's server served the calibration and every candidate until one was kept (one block of pairs each:
    # pairs_per_start and max_starts, so that neither a calibrated start effect nor a keep's confirmation asks for
    # fresh servers midway)
    until = max(p["ended"] for p in procs if p["plugin"] == "wider-batch" and p["what"].startswith("probe"))
    assert kept["ended"] >= until
    # the probes: the live greedy probe (no engines of its own), aimed at a server like the samples
    checks = query(tmp_path, "SELECT coalesce(s.plugin, 'baseline') AS plugin, m.probe, m.arm, m.server, m.metrics "
                             "FROM measurements m LEFT JOIN steps s ON s.id = m.step_id WHERE m.role = 'correctness'")
    assert checks and all(c["server"] is not None for c in checks)
    # once kept, wider-batch's own server is the kept state's: it answers the wrong candidate's control re-check
    control = next(c for c in checks if c["plugin"] == "other-weights" and c["arm"] == "control")
    served = query(tmp_path, "SELECT DISTINCT m.server FROM measurements m JOIN steps s ON s.id = m.step_id "
                             "WHERE s.plugin = 'wider-batch' AND m.arm = 'candidate' AND m.role = 'throughput'")
    assert [r["server"] for r in served] == [control["server"]]
    first = next(c for c in checks if c["plugin"] == "baseline")
    assert json.loads(first["metrics"])["recorded"] is True
    candidate = next(c for c in checks if c["plugin"] == "wider-batch")
    kernels = json.loads(candidate["metrics"])["kernel_checks"]
    assert kernels and all(k["passed"] and k["device"] == "cpu" for k in kernels)
    samples = query(tmp_path, "SELECT m.metrics FROM measurements m WHERE m.role = 'throughput' AND m.ok = 1")
    # the window's length, as the difference of two clock readings (1.5 s within rounding)
    assert all(json.loads(m["metrics"])["steady_state"] and abs(json.loads(m["metrics"])["duration"] - 1.5) < 1e-6
               for m in samples)
    assert alive_with(str(tmp_path)) == []
    assert query(tmp_path, "SELECT count(*) AS n FROM processes WHERE ended IS NULL")[0]["n"] == 0
