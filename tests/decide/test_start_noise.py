"""Decisions on live servers whose speed is fixed at each start (±10%, uniform) but varies little within one:
the A/A calibration separates the two spreads, and a run that judges by it keeps a real +25% change and no
change of no effect, at a few server starts per plugin. Real CLI, real HTTP servers, a real SQLite history."""
from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).parent / "standin"
SPREAD, WITHIN = 0.10, 0.01
BETWEEN = 2 * SPREAD / math.sqrt(12)  # sd of a uniform factor in 1 ± SPREAD (log ≈ relative at this size)
NO_OPS = 10


def project(tmp: Path, plugins: dict[str, str | None], policy: dict) -> Path:
    """A files target served by the stand-in; each plugin either sets the state's speed or adds a note file."""
    (tmp / "target").mkdir(parents=True)
    (tmp / "plugins").mkdir()
    (tmp / "target" / "speed.txt").write_text("1.0\n")
    for order, (plugin, speed) in enumerate(plugins.items()):
        folder = tmp / "plugins" / plugin
        (folder / "files").mkdir(parents=True)
        if speed is None:
            (folder / "files" / "note.txt").write_text(f"{plugin}\n")
            apply = [{"deploy": {"src": "files/note.txt", "dest": f"{plugin}.txt"}}]
        else:
            apply = [{"replace": {"path": "speed.txt", "old": "1.0", "new": speed}}]
        (folder / "plugin.yaml").write_text(yaml.safe_dump({"id": plugin, "order": order, "apply": apply}))
    config = {"target": {"kind": "files", "root": "target",
                         "server": {"command": ["python", str(STANDIN / "server.py"), "--port", "{port}"],
                                    "arms": "coresident"}},
              "plugins": "plugins", "state": "state",
              "probes": [{"name": "speed", "role": "throughput", "objective": "ops", "server": True, "timeout": 30,
                          "command": ["python", str(STANDIN / "probe.py")]}],
              "policy": policy}
    (tmp / "orchestrator.yaml").write_text(yaml.safe_dump(config))
    return tmp


def cli(root: Path, *args: str, spread: float = SPREAD, aging: float = 0.0, machine: float = 1.0
        ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "STANDIN_STARTS": str(root / "starts.txt"),
           "STANDIN_SPREAD": str(spread), "STANDIN_WITHIN": str(WITHIN), "STANDIN_AGING": str(aging),
           "STANDIN_MACHINE": str(machine)}
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "--config", "orchestrator.yaml"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def rows(root: Path, sql: str) -> list[dict]:
    db = sqlite3.connect(root / "state" / "orchestrator.db")
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute(sql)]
    finally:
        db.close()


def test_calibration_separates_the_spread_within_a_start_from_the_spread_between_starts(tmp_path):
    root = project(tmp_path, {}, {"min_gain": 0.02})
    out = cli(root, "calibrate", "--starts", "8", "--pairs", "3").stdout
    [c] = rows(root, "SELECT * FROM calibrations")
    assert WITHIN / 2 <= c["within_sd"] <= WITHIN * 2, c
    assert BETWEEN / 2 <= c["between_sd"] <= BETWEEN * 2, c
    assert (c["starts"], c["pairs"], c["pairing"], c["between_df"]) == (8, 3, "coresident", 7)
    summary = json.loads(c["summary"])
    # under start effects this large a judge that ignores them keeps many no-ops; counting them, few
    assert summary["simulated"]["keep_rate_ignoring"] > 0.05
    assert summary["simulated"]["keep_rate_counting"] <= 0.025
    assert summary["aa_judged"] == 8 and summary["aa_kept"] == 0
    assert summary["pairs_per_start"] == 2  # fresh servers pay for themselves at once
    assert "between starts" in out and "A/A decisions kept: 0 of 8" in out
    # the upper bound a keep on one pair of servers must outgrow: above the estimate, shown to people
    assert c["between_sd"] < summary["ceiling"] < 3 * c["between_sd"], summary
    assert summary["raw"] == pytest.approx(c["between_sd"] ** 2) and summary["carried"] > 0
    assert f"at most {summary['ceiling']:.2%} at 90%" in out.replace("\n", " ")
    # fresh servers against the kept one: no offset but the kept server's own start effect, which is counted
    fresh = summary["fresh_offset"]
    assert fresh["low"] < 0 < fresh["high"] and "keep_rate" not in fresh, fresh
    assert "consistent with no offset" in out
    assert not rows(root, "SELECT * FROM events WHERE kind = 'warning'")
    # the kept state's server served every block; each block had a candidate server of its own
    servers = rows(root, "SELECT * FROM processes WHERE what LIKE 'live server%' ORDER BY id")
    assert len(servers) == 1 + 8 and all(s["ready"] >= s["started"] for s in servers)
    kept = servers[0]
    blocks = rows(root, "SELECT * FROM steps WHERE kind = 'calibration' ORDER BY id")
    assert len(blocks) == 8 and all(b["outcome"] == "measured" for b in blocks)
    assert kept["ended"] >= max(b["finished"] for b in blocks)
    status = json.loads(cli(root, "status", "--json").stdout)
    assert status["calibration"]["aa_kept"] == 0 and len(status["calibration"]["blocks"]) == 8


def test_calibration_shows_fresh_servers_running_ahead_of_a_long_lived_one(tmp_path):
    """Each of the first four samples a server serves slows it by 2%: the kept state's server, which serves every
    block, settles 8% slower, while a fresh candidate server of an A/A block is 1% slower over its two samples: an
    offset of about +7% that the judge would take for a gain. A fresh server's first sample is faster than its
    next, shown too: no warm-up undoes a server's aging."""
    root = project(tmp_path, {}, {"min_gain": 0.02, "max_pairs": 4})
    out = cli(root, "calibrate", "--starts", "6", "--pairs", "2", spread=0.002, aging=0.02).stdout
    summary = json.loads(rows(root, "SELECT summary FROM calibrations")[0]["summary"])
    fresh = summary["fresh_offset"]
    assert 0.03 < fresh["low"] < fresh["mean"] < 0.10, fresh
    assert fresh["keep_rate"] > 0.5 > summary["simulated"]["keep_rate_counting"], summary
    first, offset = [w["message"] for w in rows(root, "SELECT message FROM events WHERE kind = 'warning' ORDER BY id")]
    assert "fresh servers of the state measured +" in offset and "judge takes for 0" in offset
    assert "a fresh server's first sample measured +" in first and "(6 servers)" in first, first
    assert 0 < summary["first_window"]["low"] < summary["first_window"]["mean"] < 0.05, summary
    assert "fresh servers against the kept one: +" in out and "a change of no effect with that offset is kept" in out
    cli(root, "report", "--out", "report")
    assert "- fresh servers against the kept one: +" in next((root / "report").glob("*.md")).read_text()


def test_a_calibration_at_the_first_keep_measures_the_state_the_later_decisions_are_judged_against(tmp_path):
    """`at: first_keep`: nothing is calibrated until a plugin is kept; then the kept state (25% faster) is, before
    the next plugin. The decision before it is judged without start effects, those after with them."""
    plugins = {"no-op-0": None, "faster": "1.25", "no-op-1": None}
    policy = {"min_gain": 0.02, "min_pairs": 2, "max_pairs": 4,
              "calibrate": {"starts": 3, "pairs": 2, "at": "first_keep"}}
    root = project(tmp_path, plugins, policy)
    cli(root, "run")
    steps = rows(root, "SELECT * FROM steps ORDER BY id")
    order = [s["plugin"] for s in steps if s["kind"] in ("attempt", "calibration")]
    assert order == ["no-op-0", "faster", "(A/A 1)", "(A/A 2)", "(A/A 3)", "no-op-1"], order
    assert next(s for s in steps if s["plugin"] == "faster")["outcome"] == "kept"
    [c] = rows(root, "SELECT * FROM calibrations")
    blocks = json.loads(c["summary"])["blocks"]
    assert all(1.1 < v < 1.4 for b in blocks for v in b["base"] + b["cand"]), blocks  # the kept state's speed
    decisions = {s["plugin"]: json.loads(d["decision"]) for s in steps if s["kind"] == "attempt"
                 for d in rows(root, f"SELECT decision FROM decisions WHERE step_id = {s['id']}")}
    assert decisions["no-op-0"]["between"] is None and decisions["faster"]["between"] is None
    after = decisions["no-op-1"]  # the calibration's spread, with its own blocks of servers folded in
    kept_servers, blocks = after["starts"]
    assert after["between"] > 0 and after["between_df"] == c["between_df"] + blocks - 1, (after, c)
    if blocks == 1:
        assert after["between"] == c["between_sd"]


def test_a_later_part_on_the_same_history_judges_by_its_calibration_without_measuring_it_again(tmp_path):
    """A run staged in parts (benchmarks/vllm_h200: one per GPU session, the history carried from one machine to the
    next) calibrates once: the second part's decisions count the first part's start effects, and it starts no A/A
    server of its own."""
    plugins = {"faster": "1.25", "no-op-0": None, "no-op-1": None}
    policy = {"min_gain": 0.02, "min_pairs": 2, "max_pairs": 4,
              "calibrate": {"starts": 3, "pairs": 2, "at": "first_keep"}}
    root = project(tmp_path, plugins, policy)
    cli(root, "run", "--only", "faster,no-op-0")
    cli(root, "run", "--only", "no-op-1")
    [c] = rows(root, "SELECT * FROM calibrations")
    steps = rows(root, "SELECT * FROM steps ORDER BY id")
    assert [s["plugin"] for s in steps if s["run_id"] == 2 and s["kind"] in ("attempt", "calibration")] == ["no-op-1"]
    [d] = [json.loads(d["decision"]) for s in steps if s["plugin"] == "no-op-1"
           for d in rows(root, f"SELECT decision FROM decisions WHERE step_id = {s['id']}")]
    assert d["between"] > 0 and d["between_df"] >= c["between_df"], (d, c)


def test_a_history_carried_to_a_machine_that_runs_the_state_at_another_speed_is_calibrated_again(tmp_path):
    """The same history on other machines of the same fingerprint (benchmarks/vllm_h200: a part per lease). On one
    that runs the calibrated state at half the speed, the run says so and calibrates anew, counting none of the
    earlier blocks; the next run there finds that calibration, which agrees, measures no A/A server and keeps a real
    gain; on a machine at full speed again, the kept state measures against its own samples where it was kept, not
    the calibration's (another state), and the run calibrates once more."""
    plugins = {"no-op-0": None, "no-op-1": None, "faster": "1.25", "no-op-2": None}
    policy = {"min_gain": 0.02, "min_pairs": 2, "max_pairs": 4, "calibrate": {"starts": 3, "pairs": 2, "at": "start"}}
    root = project(tmp_path, plugins, policy)
    spread = 0.02  # starts within ±2%: the check is conservative (3 sds at the start effects' 90% bound)

    def warnings(run_id: int) -> list[str]:
        """The run's warnings that a calibration is not used (an A/A offset may warn besides)."""
        return [e["message"] for e in rows(root, f"SELECT * FROM events WHERE run_id = {run_id} AND kind = 'warning'")
                if "calibration" in e["message"] and "is not used" in e["message"]]

    def aa_steps(run_id: int) -> int:
        return len(rows(root, f"SELECT * FROM steps WHERE kind = 'calibration' AND run_id = {run_id}"))

    cli(root, "run", "--only", "no-op-0", spread=spread)
    [first] = rows(root, "SELECT * FROM calibrations")
    assert json.loads(first["summary"])["holding"] == []
    cli(root, "run", "--only", "no-op-1", spread=spread, machine=0.5)
    assert [c["run_id"] for c in rows(root, "SELECT * FROM calibrations ORDER BY id")] == [1, 2]
    [warning] = warnings(2)
    assert f"against calibration {first['id']} of it in run 1" in warning and "is not used" in warning
    assert -55 < float(warning.split(" measures ")[1].split("%")[0]) < -45, warning
    assert aa_steps(2) == 3  # measured here, none carried

    cli(root, "run", "--only", "faster", spread=spread, machine=0.5)
    assert not warnings(3) and aa_steps(3) == 0 and len(rows(root, "SELECT * FROM calibrations")) == 2
    [kept] = [s for s in rows(root, "SELECT * FROM steps WHERE run_id = 3 AND plugin = 'faster'")
              if s["outcome"] == "kept"]

    cli(root, "run", "--only", "no-op-2", spread=spread)
    [warning] = warnings(4)
    assert f"against its samples where faster was kept in step {kept['id']}" in warning, warning
    assert 80 < float(warning.split(" measures ")[1].split("%")[0]) < 125, warning
    assert aa_steps(4) == 3 and len(rows(root, "SELECT * FROM calibrations")) == 3


def test_a_run_that_calibrates_first_keeps_a_real_gain_and_no_no_op(tmp_path):
    plugins = {f"no-op-{i}": None for i in range(NO_OPS // 2)}
    plugins["faster"] = "1.25"
    plugins.update({f"no-op-{i}": None for i in range(NO_OPS // 2, NO_OPS)})
    policy = {"min_gain": 0.02, "min_pairs": 2, "max_pairs": 6, "max_starts": 3, "calibrate": {"starts": 6, "pairs": 2}}
    root = project(tmp_path, plugins, policy)
    cli(root, "run")
    steps = {s["plugin"]: s for s in rows(root, "SELECT * FROM steps WHERE kind = 'attempt'")}
    assert steps["faster"]["outcome"] == "kept", steps["faster"]
    false_keeps = [p for p, s in steps.items() if p.startswith("no-op") and s["outcome"] == "kept"]
    assert len(false_keeps) <= NO_OPS // 10, false_keeps
    # every decision's interval counted the calibrated start effects
    decisions = [json.loads(d["decision"]) for d in rows(root, "SELECT d.decision FROM decisions d JOIN steps s "
                                                               "ON s.id = d.step_id WHERE s.kind = 'attempt'")]
    assert len(decisions) == NO_OPS + 1 and all(d["between"] and d["ci_low"] is not None for d in decisions)
    # each decision on several blocks of servers is pooled into the spread the decisions after it count
    [c] = rows(root, "SELECT * FROM calibrations")
    ordered = [json.loads(d["decision"]) for d in rows(root, "SELECT d.decision FROM decisions d JOIN steps s ON "
                                                             "s.id = d.step_id WHERE s.kind = 'attempt' ORDER BY d.id")]
    expected = c["between_df"]
    for d in ordered:  # each counts the decisions before it and its own blocks
        kept_servers, blocks = d["starts"]
        expected += blocks - 1 if kept_servers in (1, blocks) else 0
        assert d["between_df"] == expected, (d, expected)
    assert expected > c["between_df"], ordered  # at least one decision took a second block
    # the final re-validation counted all of it (and its own blocks), and status and the report say so
    final = json.loads(rows(root, "SELECT decision FROM decisions ORDER BY id DESC LIMIT 1")[0]["decision"])
    kept_servers, blocks = final["starts"]
    assert final["between_df"] == expected + (blocks - 1 if kept_servers in (1, blocks) else 0), final
    said = f"({final['between_df']} degrees of freedom), as the latest decision counted it"
    assert said in cli(root, "status").stdout.replace("\n", " ")
    cli(root, "report", "--out", "report")
    assert said in (root / "report" / "run-1.md").read_text()
    starts = len((root / "starts.txt").read_text().split())
    in_attempts = rows(root, "SELECT count(*) AS n FROM processes p JOIN steps s ON s.id = p.step_id "
                             "WHERE p.what LIKE 'live server%' AND s.kind = 'attempt'")[0]["n"]
    assert in_attempts / (NO_OPS + 1) <= 4, in_attempts
    assert starts / (NO_OPS + 1) <= 5, starts  # with the calibration, the baseline and the final re-validation
    assert rows(root, "SELECT count(*) AS n FROM processes WHERE ended IS NULL")[0]["n"] == 0


def test_a_run_cut_short_mid_calibration_leaves_its_blocks_to_the_run_that_continues_it(tmp_path):
    """A GPU lease taken back mid-calibration: the run is killed after two of its three A/A blocks; the next run
    measures only the third and judges by all three. In another environment, the blocks are not carried."""
    policy = {"min_gain": 0.02, "min_pairs": 2, "max_pairs": 4, "calibrate": {"starts": 3, "pairs": 2}}
    roots = [project(tmp_path / name, {"no-op-0": None}, policy) for name in ("same", "moved")]
    first: dict[Path, list[dict]] = {}
    for root in roots:
        env = {**os.environ, "PYTHONPATH": str(REPO), "STANDIN_STARTS": str(root / "starts.txt"),
               "STANDIN_SPREAD": str(SPREAD), "STANDIN_WITHIN": str(WITHIN), "STANDIN_AGING": "0"}
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run", "--config", "orchestrator.yaml"],
                                cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while not ((root / "state" / "orchestrator.db").exists()
                   and len(rows(root, "SELECT 1 FROM sqlite_master WHERE name = 'calibration_blocks'")) == 1
                   and len(rows(root, "SELECT * FROM calibration_blocks")) >= 2):
            assert proc.poll() is None and time.time() < deadline, "the run ended before two A/A blocks"
            time.sleep(0.02)
        proc.kill()
        proc.wait()
        first[root] = rows(root, "SELECT * FROM calibration_blocks ORDER BY id")[:2]
        assert not rows(root, "SELECT * FROM calibrations")
    same, moved = roots
    cli(same, "run")
    [c] = rows(same, "SELECT * FROM calibrations")
    assert c["run_id"] == 2 and c["starts"] == 3
    summary = json.loads(c["summary"])
    assert summary["aa_carried"] == [b["step_id"] for b in first[same]]
    assert summary["aa_judged"] == 3 and len(summary["blocks"]) == 3
    assert [[b["base"], b["cand"]] for b in summary["blocks"][:2]] == [
        [json.loads(b["block"])["base"], json.loads(b["block"])["cand"]] for b in first[same]]
    steps = rows(same, "SELECT * FROM steps WHERE kind = 'calibration' ORDER BY id")
    assert [(s["run_id"], s["plugin"]) for s in steps][-1] == (2, "(A/A 3)")
    assert [s["plugin"] for s in steps if s["run_id"] == 2] == ["(A/A 3)"]
    assert c["between_df"] == 2  # three blocks, as one calibration
    status = json.loads(cli(same, "status", "--json").stdout)
    assert status["calibration"]["aa_judged"] == 3 and {s["plugin"] for s in status["steps"]} == {"no-op-0"}
    # another environment: the blocks measured in the first are stale, and all three are measured again
    env_moved = {"ORCHESTRATOR_FINGERPRINT_EXTRA": json.dumps({"gpu_driver": "another"})}
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--config", "orchestrator.yaml"],
                          cwd=moved, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(REPO), "STANDIN_STARTS": str(moved / "starts.txt"),
                               "STANDIN_SPREAD": str(SPREAD), "STANDIN_WITHIN": str(WITHIN), **env_moved})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [c] = rows(moved, "SELECT * FROM calibrations")
    assert json.loads(c["summary"])["aa_carried"] == []
    assert [s["plugin"] for s in rows(moved, "SELECT * FROM steps WHERE kind = 'calibration' AND run_id = 2")] == [
        "(A/A 1)", "(A/A 2)", "(A/A 3)"]
