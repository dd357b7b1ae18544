"""A whole run of the real CLI over the test plugins: every outcome and reason, history, re-run, rollback."""
from __future__ import annotations

import time

import psutil
import pytest

from core_project import make_project, tree

EXPECTED = {
    "speedup": ("kept", None),
    "half-way": ("rolled_back", "apply_failed"),
    "bad-verify": ("rolled_back", "verify_failed"),
    "breaks-answers": ("rolled_back", "incorrect"),
    "hangs": ("rolled_back", "timeout"),
    "segfaults": ("rolled_back", "crashed"),
    "no-gain": ("rolled_back", "no_gain"),
    "slower": ("rolled_back", "regressed"),
    "needs-half-way": ("skipped", "dependency_not_kept"),
    "not-for-me": ("skipped", "not_applicable"),
    "engine-only": ("skipped", "not_applicable"),
    "command-step": ("kept", None),
    "hook-step": ("kept", None),
}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    project = make_project(tmp_path_factory.mktemp("e2e") / "proj")
    original = tree(project.target)
    proc = project.cli("run")
    return project, original, proc


def test_every_outcome_and_reason(ran):
    project, _, proc = ran
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert project.outcomes() == EXPECTED
    # each probe failure was re-checked on the last kept state, which passed it: the candidates' failures stand
    controls = {s["plugin"]: s["control"] for s in project.status()["steps"] if s["control"]}
    assert {p: (c["probe"], c["passed"]) for p, c in controls.items()} == {
        "breaks-answers": ("correct", True), "hangs": ("speed", True), "segfaults": ("speed", True)}


def test_kept_changes_are_exactly_on_disk(ran):
    project, original, _ = ran
    now = tree(project.target)
    assert now["app.txt"] == b"SPEED = 4\nLATENCY = 10\nMODE = plain\n"
    assert now["conf/serve.yaml"] == original["conf/serve.yaml"].replace(b"0.9  #", b"0.95 #")
    assert now["blob.bin"] == original["blob.bin"]
    # nothing left by rolled-back plugins: no deployed files, no created folders, no temporary files
    assert set(now) == set(original) | {"gen", "gen/env.txt"}


def test_status_json_follows_the_contract(ran):
    project, _, _ = ran
    data = project.status()
    assert data["run"]["status"] == "finished" and isinstance(data["run"]["id"], int)
    assert data["baseline"]["score"] == pytest.approx(100)
    steps = {s["plugin"]: s for s in data["steps"]}
    assert steps["speedup"]["gain"] == pytest.approx(1.0)
    assert steps["speedup"]["metrics"]["score"] == pytest.approx(200)
    assert steps["slower"]["gain"] == pytest.approx(-0.5)
    assert steps["speedup"]["decision"]["n_candidate"] == 2
    assert steps["half-way"]["gain"] is None and "NOT THERE" in steps["half-way"]["detail"]


def test_command_steps_see_the_documented_environment(ran):
    project, _, _ = ran
    env = dict(eval((project.target / "gen" / "env.txt").read_text().removesuffix(" cost $5")))
    assert env["ORCHESTRATOR_PLUGIN"] == "command-step"
    assert env["ORCHESTRATOR_ROOT_TARGET"] == env["ORCHESTRATOR_TARGET_ROOT"] == str(project.target.resolve())
    assert env["ORCHESTRATOR_PLUGIN_DIR"] == str((project.path / "plugins" / "command-step").resolve())


def test_hung_probe_and_its_child_are_killed_and_output_kept(ran):
    project, _, _ = ran
    child = int((project.path / "hang-child.pid").read_text())
    deadline = time.time() + 5
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    db = project.db()
    hang = db.execute("SELECT m.* FROM measurements m JOIN steps s ON s.id = m.step_id "
                      "WHERE s.plugin = 'hangs' AND m.role = 'throughput'").fetchone()
    assert hang["reason"] == "timeout" and "hanging" in hang["stdout_tail"]
    segv = db.execute("SELECT m.* FROM measurements m JOIN steps s ON s.id = m.step_id "
                      "WHERE s.plugin = 'segfaults' AND m.role = 'throughput'").fetchone()
    assert segv["reason"] == "crashed" and segv["returncode"] == -11 and "about to crash" in segv["stdout_tail"]
    assert db.execute("SELECT COUNT(*) FROM processes WHERE ended IS NULL").fetchone()[0] == 0


def test_sequential_mode_measures_the_baseline_once(ran):
    project, _, _ = ran
    db = project.db()
    arms = db.execute("SELECT arm, COUNT(*) FROM measurements m LEFT JOIN steps s ON s.id = m.step_id "
                      "WHERE role = 'throughput' AND (s.plugin IS NULL OR s.plugin != '(final)') GROUP BY arm").fetchall()
    # two initial baseline samples, reused; two candidate samples per judged plugin, one each for hangs and segfaults,
    # whose failures were each re-checked once on the last kept state
    assert dict(arms) == {"baseline": 2, "candidate": 2 * 5 + 2, "control": 2}
    decisions = db.execute("SELECT s.plugin FROM decisions d JOIN steps s ON s.id = d.step_id").fetchall()
    # speedup, no-gain, slower, command-step, hook-step, then the kept stack, re-validated in interleaved pairs
    assert sorted(r[0] for r in decisions) == sorted(["speedup", "no-gain", "slower", "command-step", "hook-step",
                                                      "(final)"])
    final = db.execute("SELECT arm, COUNT(*) FROM measurements m JOIN steps s ON s.id = m.step_id "
                       "WHERE s.plugin = '(final)' GROUP BY arm").fetchall()
    assert dict(final) == {"baseline": 2, "candidate": 2}


def test_rerun_is_idempotent_then_rollback_all_restores_every_byte(ran):
    project, original, _ = ran
    before = tree(project.target)
    assert project.cli("run", "--only", "speedup,command-step,hook-step,slower", check=0)
    outcomes = project.outcomes()
    assert outcomes["speedup"] == outcomes["command-step"] == outcomes["hook-step"] == ("kept", "already_applied")
    assert outcomes["slower"] == ("rolled_back", "apply_failed")  # SPEED = 2 is gone: judged on the kept state
    assert tree(project.target) == before

    # someone edits a kept file: rollback refuses, changes nothing, then --force overwrites
    app = project.target / "app.txt"
    app.write_bytes(app.read_bytes() + b"# local edit\n")
    edited = tree(project.target)
    refused = project.cli("rollback", "--all", check=1)
    assert "changed since" in refused.stderr and "app.txt" in refused.stderr
    assert tree(project.target) == edited
    project.cli("rollback", "--all", "--force", check=0)
    assert tree(project.target) == original
    assert project.cli("rollback", "--all", check=0).stdout.strip() == "nothing to roll back"
    runs = project.cli("status", "--runs", check=0).stdout
    assert "rollback" in runs


def test_rollback_by_id(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup", "hook-step"])
    original = tree(project.target)
    project.cli("run", check=0)
    assert project.outcomes() == {"speedup": ("kept", None), "hook-step": ("kept", None)}
    project.cli("rollback", "hook-step", check=0)
    assert (project.target / "app.txt").read_text().startswith("SPEED = 2\n")
    again = project.cli("rollback", "hook-step", check=1)
    assert "not kept" in again.stderr
    project.cli("rollback", "speedup", check=0)
    assert tree(project.target) == original


def test_unmeasurable_baseline_fails_the_run_and_changes_nothing(tmp_path):
    import yaml
    project = make_project(tmp_path / "p", plugins=["speedup"])
    assert "no runs recorded" in project.cli("status", check=1).stderr
    config = yaml.safe_load(project.config.read_text())
    config["probes"][1]["objective"] = "tokens_per_s"  # the probe reports `score`
    project.config.write_text(yaml.safe_dump(config))
    original = tree(project.target)
    proc = project.cli("run", check=1)
    assert "cannot measure the baseline" in proc.stderr and "no finite number at 'tokens_per_s'" in proc.stderr
    assert project.status()["run"]["status"] == "failed"
    assert tree(project.target) == original
