"""The configuration probe through the real CLI on a files target: a candidate whose effective configuration
equals the last kept state's is rolled back as no_gain without a correctness probe or a throughput sample; one
that changes it is measured; a configuration probe that fails on the candidate goes through the control check."""
from __future__ import annotations

import json

import yaml

from core_project import Project, tree

ORIGINAL = {"app.ini": b"threads = 1\ncomment = plain\nlog_level = info\n"}

# The app reads only `threads`; `log_level` it ignores, so a change of it changes nothing that runs.
CONFIGURATION = '''
import json, os, sys
from pathlib import Path
root = Path(os.environ["ORCHESTRATOR_TARGET_ROOT"])
keys = dict(line.split(" = ", 1) for line in (root / "app.ini").read_text().splitlines())
if keys.get("threads") == "broken":
    print("cannot parse threads", flush=True)
    sys.exit(4)
print(json.dumps({"configuration": {"threads": int(keys["threads"])},
                  "ignored": {k: "the app never reads it" for k in keys if k != "threads"}}))
'''
CORRECT = '''
import json
print(json.dumps({"passed": True}))
'''
SPEED = '''
import json, os
from pathlib import Path
root = Path(os.environ["ORCHESTRATOR_TARGET_ROOT"])
threads = int(dict(l.split(" = ", 1) for l in (root / "app.ini").read_text().splitlines())["threads"])
print(json.dumps({"score": 100.0 * threads}))
'''

PLUGINS = {
    "quiet-logs": {"order": 10, "apply": [{"replace": {"path": "app.ini", "old": "log_level = info",
                                                       "new": "log_level = warning"}}]},
    "more-threads": {"order": 20, "apply": [{"replace": {"path": "app.ini", "old": "threads = 1",
                                                         "new": "threads = 4"}}]},
    "bad-threads": {"order": 30, "apply": [{"replace": {"path": "app.ini", "old": "threads = 4",
                                                        "new": "threads = broken"}}]},
    "two-threads": {"order": 40, "apply": [{"replace": {"path": "app.ini", "old": "threads = 4",
                                                        "new": "threads = 2"}}]},
    # the same change as two-threads, spelt otherwise (and with a comment the app ignores)
    "halve-threads": {"order": 50, "apply": [{"replace": {"path": "app.ini", "old": "threads = 4\ncomment = plain",
                                                          "new": "threads = 2\ncomment = halved"}}]},
}


def make(path) -> Project:
    (path / "target").mkdir(parents=True)
    for name, data in ORIGINAL.items():
        (path / "target" / name).write_bytes(data)
    for name, text in (("configuration.py", CONFIGURATION), ("correct.py", CORRECT), ("speed.py", SPEED)):
        (path / name).write_text(text)
    for pid, manifest in PLUGINS.items():
        (path / "plugins" / pid).mkdir(parents=True)
        (path / "plugins" / pid / "plugin.yaml").write_text(yaml.safe_dump({"id": pid, **manifest}))
    config = {"target": {"kind": "files", "root": "target"}, "plugins": "plugins", "state": "state",
              "probes": [{"name": "effective", "role": "configuration", "command": ["python", "configuration.py"]},
                         {"name": "correct", "role": "correctness", "command": ["python", "correct.py"]},
                         {"name": "speed", "role": "throughput", "command": ["python", "speed.py"],
                          "objective": "score"}],
              "policy": {"rule": "first", "repeats": 2, "min_pairs": 2, "max_pairs": 3}}
    (path / "orchestrator.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return Project(path)


def test_a_change_the_target_ignores_is_rolled_back_unmeasured_and_the_others_are_judged(tmp_path):
    project = make(tmp_path / "p")
    project.cli("run", check=0)
    data = project.status()
    outcomes = {s["plugin"]: (s["outcome"], s["reason"]) for s in data["steps"]}
    assert outcomes == {"quiet-logs": ("rolled_back", "no_gain"), "more-threads": ("kept", None),
                        "bad-threads": ("rolled_back", "probe_failed"), "two-threads": ("rolled_back", "regressed"),
                        "halve-threads": ("rolled_back", "regressed")}
    quiet = next(s for s in data["steps"] if s["plugin"] == "quiet-logs")
    assert "no effect here" in quiet["detail"] and "log_level: the app never reads it" in quiet["detail"]
    assert quiet["decision"]["rule"] == "configuration" and quiet["decision"]["verdict"] == "no_gain"
    rows = [(r["plugin"], r["probe"], r["arm"]) for r in project.db().execute(
        "SELECT coalesce(s.plugin, 'baseline') AS plugin, m.probe, m.arm FROM measurements m "
        "LEFT JOIN steps s ON s.id = m.step_id ORDER BY m.id")]
    # quiet-logs: its configuration was read, nothing else ran on it
    assert [r for r in rows if r[0] == "quiet-logs"] == [("quiet-logs", "effective", "candidate")]
    assert ("more-threads", "speed", "candidate") in rows and ("more-threads", "correct", "candidate") in rows
    # the kept state's configuration is now more-threads': bad-threads is compared with it and fails to read,
    # which the last kept state does not (its control)
    bad = next(s for s in data["steps"] if s["plugin"] == "bad-threads")
    assert "cannot parse threads" in bad["detail"] and bad["control"]["passed"] is True
    # halve-threads changes what two-threads changed, against the same kept state: judged once, not twice
    halve = next(s for s in data["steps"] if s["plugin"] == "halve-threads")
    assert "runs what two-threads ran" in halve["detail"] and "not measured again" in halve["detail"]
    assert [r for r in rows if r[0] == "halve-threads"] == [("halve-threads", "effective", "candidate")]
    assert ("two-threads", "speed", "candidate") in rows
    assert tree(project.target) == {"app.ini": b"threads = 4\ncomment = plain\nlog_level = info\n"}
    results = [json.loads(r["metrics"]) for r in project.db().execute(
        "SELECT metrics FROM measurements WHERE probe = 'effective' AND arm = 'baseline'")]
    assert results == [{"configuration": {"threads": 1}, "ignored": {"comment": "the app never reads it",
                                                                     "log_level": "the app never reads it"}}]


def test_without_a_configuration_probe_every_candidate_is_measured(tmp_path):
    project = make(tmp_path / "p")
    config = yaml.safe_load((project.path / "orchestrator.yaml").read_text())
    config["probes"] = config["probes"][1:]
    (project.path / "orchestrator.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    project.cli("run", "--only", "quiet-logs", check=0)
    assert project.outcomes()["quiet-logs"] == ("rolled_back", "no_gain")
    probes = [r["probe"] for r in project.db().execute(
        "SELECT m.probe FROM measurements m JOIN steps s ON s.id = m.step_id WHERE s.plugin = 'quiet-logs'")]
    assert probes.count("speed") >= 4  # measured: two pairs at least, the same score on both arms


def test_a_configuration_as_long_as_vllms_is_stored_whole(tmp_path):
    """vLLM's resolved config runs to tens of thousands of characters: the history keeps each state's reading whole
    (what a rollback "runs what the kept state runs" rests on), where a throughput result that long keeps only its
    numbers."""
    project = make(tmp_path / "p")
    script = (project.path / "configuration.py").read_text().replace(
        '{"threads": int(keys["threads"])}',
        '{"threads": int(keys["threads"]), **{f"compilation.size_{i}": [i] * 4 for i in range(3000)}}')
    (project.path / "configuration.py").write_text(script)
    (project.path / "speed.py").write_text(SPEED.replace('print(json.dumps({"score": 100.0 * threads}))',
                                                         'print(json.dumps({"score": 100.0 * threads, '
                                                         '"padding": "x" * 100_000}))'))
    project.cli("run", "--only", "quiet-logs,more-threads", check=0)
    assert project.outcomes() == {"quiet-logs": ("rolled_back", "no_gain"), "more-threads": ("kept", None)}
    readings = {(r["arm"], r["plugin"]): json.loads(r["metrics"]) for r in project.db().execute(
        "SELECT m.arm, coalesce(s.plugin, 'baseline') AS plugin, m.metrics FROM measurements m "
        "LEFT JOIN steps s ON s.id = m.step_id WHERE m.role = 'configuration' AND m.ok = 1")}
    assert set(readings) == {("baseline", "baseline"), ("candidate", "quiet-logs"), ("candidate", "more-threads")}
    assert len(json.dumps(readings["baseline", "baseline"])) > 50_000
    assert readings["baseline", "baseline"]["configuration"]["compilation.size_2999"] == [2999] * 4
    assert readings["candidate", "more-threads"]["configuration"]["threads"] == 4
    speeds = [json.loads(r["metrics"]) for r in project.db().execute(
        "SELECT metrics FROM measurements WHERE probe = 'speed' AND ok = 1")]
    assert speeds and all("padding" not in m and m["score"] in (100.0, 400.0) and "cut" in m for m in speeds)
