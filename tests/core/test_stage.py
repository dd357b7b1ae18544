"""The staging loop in-process: byte-exact rollbacks, interleaved A/B measurement, verdicts, params."""
from __future__ import annotations

import json

import pytest
import yaml

from core_project import MAIN_PLUGINS, add_plugin, make_project, set_probes, tree
from orchestrator import decide
from orchestrator.config import load
from orchestrator.journal import Journal
from orchestrator.plugin import load_all
from orchestrator.context import Reporter
from orchestrator.loop import run
from orchestrator.store import Store


def stage(project, reporter=None):
    proj = load(project.config)
    plugins = load_all(proj.plugins_dir, proj.target.roots, proj.target.vars)
    store = Store(proj.db_path)
    run_id = run(proj, plugins, store, Journal(store, proj.state_dir, proj.target.roots), reporter)
    return store, run_id


def outcomes(store, run_id):
    """Plugin attempts only, not the re-measurements of the kept stack."""
    return [(s["plugin"], s["outcome"], s["reason"]) for s in store.steps(run_id) if s["kind"] == "attempt"]


class TreeWatcher(Reporter):
    """Snapshots the target when a plugin starts applying and when it is rolled back."""

    def __init__(self, root):
        self.root, self.before, self.pairs = root, {}, []

    def phase(self, plugin, phase):
        if phase == "apply":
            self.before[plugin] = tree(self.root)

    def outcome(self, plugin, outcome, reason, gain):
        if outcome == "rolled_back":
            self.pairs.append((plugin, self.before[plugin], tree(self.root)))


def test_every_rollback_leaves_the_target_byte_for_byte(tmp_path):
    project = make_project(tmp_path / "p", plugins=[p for p in MAIN_PLUGINS if p != "hangs"])
    watcher = TreeWatcher(project.target)
    store, run_id = stage(project, watcher)
    rolled = {p for p, _, _ in watcher.pairs}
    assert rolled == {"half-way", "bad-verify", "breaks-answers", "segfaults", "no-gain", "slower"}
    for plugin, before, after in watcher.pairs:
        assert after == before, plugin


def set_policy(project, **policy):
    config = yaml.safe_load(project.config.read_text())
    config["policy"] = policy
    project.config.write_text(yaml.safe_dump(config))


class ScriptedJudge(decide.Judge):
    """Decides after a fixed number of pairs, recording what it was shown; the real loop of pairs
    (`until_decided`) asks it, and takes its keeps as they are."""

    seen: list = []
    pairs = 3
    verdict = "keep"

    def __init__(self, policy, noise=None):
        self.policy = policy

    def doubt(self, baseline, candidate, starts):
        return None

    def decide(self, baseline, candidate, final, starts=None, plan=None):
        ScriptedJudge.seen.append((list(baseline), list(candidate), final))
        if len(baseline) < ScriptedJudge.pairs and not final:
            return None
        return decide.Decision(ScriptedJudge.verdict, 0.5, ci_low=0.4, ci_high=0.6, n_baseline=len(baseline),
                               n_candidate=len(candidate), baseline_median=100.0, candidate_median=150.0, rule="stat")


@pytest.fixture
def scripted(monkeypatch):
    ScriptedJudge.seen, ScriptedJudge.pairs, ScriptedJudge.verdict = [], 3, "keep"
    monkeypatch.setattr(decide, "Judge", ScriptedJudge)
    return ScriptedJudge


def test_interleaved_pairs_alternate_images_until_the_judge_decides(tmp_path, scripted):
    project = make_project(tmp_path / "p", plugins=["speedup"])
    set_policy(project, interleave=True, min_pairs=2, max_pairs=5)
    store, run_id = stage(project)
    assert outcomes(store, run_id) == [("speedup", "kept", None)]
    # 3 initial baseline samples (repeats default), then B A, A B, B A: the first pair starts with the candidate,
    # which its correctness probe left on disk, and each pair reverses the one before
    log = (project.path / "probe-log.txt").read_text().split("\n")
    assert log[:9] == ["baseline 1"] * 3 + ["speedup 2", "speedup 1", "speedup 1", "speedup 2", "speedup 2",
                                            "speedup 1"]
    step = store.steps(run_id)[0]["id"]
    arms = store.query("SELECT arm, repeat FROM measurements WHERE step_id = ? AND role = 'throughput' "
                       "ORDER BY id", [step])
    assert [(r["arm"], r["repeat"]) for r in arms] == [("candidate", 0), ("baseline", 0), ("baseline", 1),
                                                       ("candidate", 1), ("candidate", 2), ("baseline", 2)]
    assert [len(b) for b, _, _ in scripted.seen[:3]] == [1, 2, 3]
    assert scripted.seen[2][:2] == ([100.0] * 3, [200.0] * 3)
    assert [final for _, _, final in scripted.seen[:3]] == [False, False, False]
    row = store.query("SELECT * FROM decisions")[0]
    assert json.loads(row["decision"])["ci_low"] == 0.4 and row["n_candidate"] == 3
    assert (project.target / "app.txt").read_text().startswith("SPEED = 2")


def test_interleaved_stops_at_max_pairs_with_final(tmp_path, scripted):
    scripted.pairs = 99
    project = make_project(tmp_path / "p", plugins=["speedup"])
    set_policy(project, interleave=True, min_pairs=1, max_pairs=2, repeats=1)
    stage(project)
    assert [final for _, _, final in scripted.seen[:2]] == [False, True]


@pytest.mark.parametrize("decide_at, finals", [(3, [False, False, False]), (99, [False, False, False, True])])
def test_sequential_adds_candidate_samples_until_the_judge_decides(tmp_path, monkeypatch, decide_at, finals):
    seen = []

    class CandidateJudge(ScriptedJudge):
        def decide(self, baseline, candidate, final, starts=None, plan=None):
            seen.append((len(baseline), len(candidate), final))
            if len(candidate) < decide_at and not final:
                return None
            return decide.Decision("keep", 0.5, ci_low=0.4, ci_high=0.6, n_baseline=len(baseline),
                                   n_candidate=len(candidate), baseline_median=100.0, candidate_median=150.0)

    monkeypatch.setattr(decide, "Judge", CandidateJudge)
    project = make_project(tmp_path / "p", plugins=["speedup"])
    set_policy(project, interleave=False, rule="stat", repeats=2, min_pairs=2, max_pairs=4)
    store, run_id = stage(project)
    assert outcomes(store, run_id) == [("speedup", "kept", None)]
    # the run's baseline samples are reused; candidate samples are added one at a time
    assert seen[:len(finals)] == [(2, i + 1, final) for i, final in enumerate(finals)]
    log = (project.path / "probe-log.txt").read_text().split("\n")[:-1]
    assert log[:2 + len(finals)] == ["baseline 1"] * 2 + ["speedup 2"] * len(finals)


@pytest.mark.parametrize("on_inconclusive, expected", [("rollback", ("rolled_back", "inconclusive")),
                                                        ("keep", ("kept", "inconclusive"))])
def test_inconclusive_follows_policy(tmp_path, scripted, on_inconclusive, expected):
    scripted.verdict, scripted.pairs = "inconclusive", 1
    project = make_project(tmp_path / "p", plugins=["speedup"])
    original = tree(project.target)
    set_policy(project, interleave=True, min_pairs=1, max_pairs=1, repeats=1, on_inconclusive=on_inconclusive)
    store, run_id = stage(project)
    assert outcomes(store, run_id) == [("speedup", *expected)]
    assert (tree(project.target) == original) == (expected[0] == "rolled_back")


def test_guardrail_veto_rolls_back_and_is_stored(tmp_path, monkeypatch):
    calls = []

    def guard(guardrails, base, cand):
        calls.append((guardrails, base, cand))
        return ["p99_ms 10 > 5"]
    monkeypatch.setattr("orchestrator.stage.check_guardrails", guard)
    project = make_project(tmp_path / "p", plugins=["speedup"])
    set_policy(project, interleave=False, rule="first", repeats=2, guardrails={"p99_ms": "<= 5"})
    original = tree(project.target)
    store, run_id = stage(project)
    assert outcomes(store, run_id) == [("speedup", "rolled_back", "guardrail")]
    assert tree(project.target) == original
    guardrails, base, cand = calls[0]
    assert guardrails == {"p99_ms": "<= 5"} and cand[0] == {"score": 200.0, "p99_ms": 10.0}
    assert json.loads(store.query("SELECT vetoes FROM decisions")[0]["vetoes"]) == ["p99_ms 10 > 5"]


def test_accept_overrides_policy_per_plugin(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup"])
    manifest = project.path / "plugins" / "speedup" / "plugin.yaml"
    manifest.write_text(manifest.read_text() + "accept: {min_gain: 1.5}\n")
    store, run_id = stage(project)
    assert outcomes(store, run_id) == [("speedup", "rolled_back", "no_gain")]
    assert json.loads(store.query("SELECT policy FROM decisions")[0]["policy"])["min_gain"] == 1.5


def test_params_stage_every_combination_and_keep_the_best(tmp_path):
    project = make_project(tmp_path / "p", plugins=[], extra=["tune-speed"])
    store, run_id = stage(project)
    steps = [s for s in store.steps(run_id) if s["plugin"] == "tune-speed"]
    assert [(json.loads(s["params"]), s["outcome"], s["reason"]) for s in steps] == [
        ({"speed": 2}, "rolled_back", "outperformed"),
        ({"speed": 5}, "kept", None),
        ({"speed": 3}, "rolled_back", "outperformed"),
    ]
    assert [s["gain"] for s in steps] == pytest.approx([1.0, 4.0, 2.0])
    assert (project.target / "app.txt").read_text().startswith("SPEED = 5\n")
    assert json.loads(store.deployed()["tune-speed"]["params"]) == {"speed": 5}


def test_fingerprint_is_stored_with_each_measurement_when_available(tmp_path, monkeypatch):
    from orchestrator import fingerprint
    monkeypatch.setattr(fingerprint, "fingerprint", lambda: {"gpu": "test-gpu", "clock_mhz": 1980})
    project = make_project(tmp_path / "p", plugins=["speedup"])
    store, _ = stage(project)
    rows = store.query("SELECT fingerprint FROM measurements WHERE role = 'throughput'")
    assert rows and all(json.loads(r["fingerprint"]) == {"gpu": "test-gpu", "clock_mhz": 1980} for r in rows)


def test_interleaved_with_the_project_judge_keeps_a_clear_win(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_NOISE", "0.01")
    project = make_project(tmp_path / "p", plugins=["speedup"])
    set_policy(project, interleave=True, repeats=3, min_pairs=3, max_pairs=8)
    store, run_id = stage(project)
    assert outcomes(store, run_id) == [("speedup", "kept", None)]
    counts = {r["arm"]: r["n"] for r in store.query(
        "SELECT arm, COUNT(*) AS n FROM measurements WHERE role = 'throughput' AND step_id IS NOT NULL GROUP BY arm")}
    assert counts["baseline"] == counts["candidate"] >= 3


# The deployment logs every correctness check into the target; an operator leaves a note while a candidate is on disk.
LOGGING_PROBE = """\
import json, os, pathlib
root = pathlib.Path(os.environ["ORCHESTRATOR_TARGET_ROOT"])
with open(root / "deploy.log", "a") as log:
    log.write(os.environ["ORCHESTRATOR_PLUGIN"] + "\\n")
if os.environ["ORCHESTRATOR_PLUGIN"] != "baseline":
    (root / "operator-notes.txt").write_text("seen\\n")
print(json.dumps({"passed": True}))
"""


def test_rolling_back_a_command_step_undoes_only_what_it_changed(tmp_path):
    project = make_project(tmp_path / "p", plugins=[])
    (project.path / "probes" / "logging_correct.py").write_text(LOGGING_PROBE)
    set_probes(project, [{"name": "correct", "role": "correctness", "command": ["python", "probes/logging_correct.py"],
                          "timeout": 30},
                         {"name": "speed", "role": "throughput", "command": ["python", "probes/speed.py"],
                          "timeout": 30, "objective": "score"}])
    add_plugin(project, {"id": "gen", "apply": [{"command": {"run": ["python", "-c", (
        "import pathlib; pathlib.Path('gen').mkdir(); pathlib.Path('gen/x.txt').write_text('x'); "
        "app = pathlib.Path('app.txt'); app.write_text(app.read_text() + '# generated\\n')")]}}]})
    original = tree(project.target)
    project.cli("run", check=0)
    assert project.outcomes() == {"gen": ("rolled_back", "no_gain")}
    log = (project.target / "deploy.log").read_bytes()
    assert log.startswith(b"baseline\n") and b"gen\n" in log
    assert tree(project.target) == {**original, "deploy.log": log, "operator-notes.txt": b"seen\n"}
    detail = " ".join(project.status()["steps"][0]["detail"].split())
    for name in ("deploy.log", "operator-notes.txt"):
        assert name in detail, detail
