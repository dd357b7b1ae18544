"""The control re-check through the real CLI on a files target: a probe the candidate fails is re-run on the last
kept state; when that fails too the environment is blamed, the run stops, and the next run continues it."""
from __future__ import annotations

import signal
import time

import pytest
import yaml

from core_project import Project, tree

ORIGINAL = {"app.txt": b"SPEED = 1\nMODE = plain\n"}

# Every probe counts its calls; once a probe of its role has been called BREAK_AT times, the flag file appears
# (the machine goes bad mid-run) and from then on that probe fails for every state until the flag is removed.
COMMON = '''
import json, os, re, sys
from pathlib import Path
here = Path(__file__).parent
root = Path(os.environ["ORCHESTRATOR_TARGET_ROOT"])
counter = here / f"{ROLE}-calls.txt"
calls = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(calls))
with open(here / "probe-log.txt", "a") as log:
    log.write(f"{ROLE} {os.environ['ORCHESTRATOR_PLUGIN']}\\n")
trigger = here / f"break-{ROLE}-at.txt"
if trigger.exists() and calls >= int(trigger.read_text()):
    (here / "flag").write_text("broken")
broken = (here / "flag").exists()
hang = here / f"hang-{ROLE}-at.txt"  # the run is cut short here: the test stops it while this probe hangs
if hang.exists() and calls == int(hang.read_text()):
    (here / "hanging").write_text(str(os.getpid()))
    import time
    time.sleep(300)
text = (root / "app.txt").read_text()
'''
CORRECT = 'ROLE = "correct"\n' + COMMON + '''
print("checking answers")
if broken:
    print("the answer server is unreachable", flush=True)
    sys.exit(3)
print(json.dumps({"passed": "MODE = BROKEN" not in text}))
'''
SPEED = ('ROLE = "speed"\n' + COMMON).replace("import json, os, re, sys", "import json, os, re, signal, sys") + '''
if broken:
    print("segfault in the benchmark", flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)
speed = float(re.search(r"SPEED = (\\d+)", text).group(1))
print(json.dumps({"score": 100 * speed * (1.5 if (root / "c.txt").exists() else 1)}))
'''

PLUGINS = {
    "a": {"order": 10, "apply": [{"replace": {"path": "app.txt", "old": "SPEED = 1", "new": "SPEED = 2"}}]},
    "b": {"order": 20, "apply": [{"replace": {"path": "app.txt", "old": "MODE = plain", "new": "MODE = BROKEN"}}]},
    "c": {"order": 30, "apply": [{"command": {"run": ["python", "-c", "open('c.txt', 'w').write('C\\n')"]}}]},
    "d": {"order": 40, "apply": [{"replace": {"path": "app.txt", "old": "SPEED = 2", "new": "SPEED = 3"}}]},
}


def make(path) -> Project:
    (path / "target").mkdir(parents=True)
    for name, data in ORIGINAL.items():
        (path / "target" / name).write_bytes(data)
    (path / "correct.py").write_text(CORRECT)
    (path / "speed.py").write_text(SPEED)
    for pid, manifest in PLUGINS.items():
        (path / "plugins" / pid).mkdir(parents=True)
        (path / "plugins" / pid / "plugin.yaml").write_text(yaml.safe_dump({"id": pid, **manifest}))
    config = {"target": {"kind": "files", "root": "target"}, "plugins": "plugins", "state": "state",
              "probes": [{"name": "correct", "role": "correctness", "command": ["python", "correct.py"], "timeout": 30},
                         {"name": "speed", "role": "throughput", "command": ["python", "speed.py"], "timeout": 30,
                          "objective": "score"}],
              "policy": {"rule": "first", "interleave": False, "repeats": 1, "min_pairs": 2, "max_pairs": 3}}
    (path / "orchestrator.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return Project(path)


def steps(data: dict) -> dict[str, tuple]:
    return {s["plugin"]: (s["outcome"], s["reason"]) for s in data["steps"]}


# correctness calls: baseline 1, a 2, b 3 (incorrect), b's control 4, c 5 (breaks), c's control 6
# speed calls: baseline 1, a 2, c 3 (breaks), c's control 4
@pytest.mark.parametrize("role, probe, at, reason", [("correct", "correct", 5, "exited with status 3"),
                                                      ("speed", "speed", 3, "ended by signal SIGSEGV")])
def test_an_environment_failure_mid_run_stops_it_and_the_next_run_continues(tmp_path, role, probe, at, reason):
    project = make(tmp_path / "p")
    (project.path / f"break-{role}-at.txt").write_text(str(at))
    first = project.cli("run", check=1)
    # the run stops, naming the probe that failed on the kept state too, with its output tail
    assert f"probe {probe} fails on the last kept state too" in first.stderr and reason in first.stderr
    tail = "the answer server is unreachable" if role == "correct" else "segfault in the benchmark"
    assert tail in first.stderr
    data = project.status()
    assert data["run"]["status"] == "failed"
    assert steps(data) == {"a": ("kept", None), "b": ("rolled_back", "incorrect"),
                           "c": ("rolled_back", "environment_failed")}  # d was never attempted
    controls = {s["plugin"]: s["control"] for s in data["steps"]}
    assert controls["a"] is None
    assert controls["b"]["probe"] == "correct" and controls["b"]["passed"] is True
    assert controls["c"]["probe"] == probe and controls["c"]["passed"] is False and reason in controls["c"]["detail"]
    assert "control" in project.cli("status", check=0).stdout
    # the target holds exactly the last kept state: a's change, nothing of c
    assert tree(project.target) == {"app.txt": b"SPEED = 2\nMODE = plain\n"}
    arms = [(r["plugin"], r["probe"], r["arm"], r["ok"]) for r in project.db().execute(
        "SELECT s.plugin, m.probe, m.arm, m.ok FROM measurements m JOIN steps s ON s.id = m.step_id "
        "WHERE m.arm = 'control' ORDER BY m.id")]
    assert arms == [("b", "correct", "control", 1), ("c", probe, "control", 0)]
    log = (project.path / "probe-log.txt").read_text()
    assert " d\n" not in log and "(final)" not in log  # nothing staged or re-measured after the stop
    assert "correct (control of b)\n" in log and f"{probe} (control of c)\n" in log  # what the probes are told

    # the environment is repaired: the next run continues where the first stopped
    (project.path / "flag").unlink()
    (project.path / f"break-{role}-at.txt").unlink()
    project.cli("run", check=0)
    again = project.status()
    assert again["run"]["status"] == "finished"
    assert steps(again) == {"a": ("kept", "already_applied"), "b": ("skipped", "decided_earlier"),
                            "c": ("kept", None), "d": ("kept", None)}
    assert "run 1 (incorrect)" in next(s["detail"] for s in again["steps"] if s["plugin"] == "b")
    assert tree(project.target) == {"app.txt": b"SPEED = 3\nMODE = plain\n", "c.txt": b"C\n"}
    # the two runs are one: the final re-validation measures everything they kept against the first's baseline
    assert again["final"]["gain"] == pytest.approx(3 * 1.5 - 1)
    project.cli("rollback", "--all", check=0)
    assert tree(project.target) == ORIGINAL


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_run_killed_or_stopped_by_a_signal_is_continued_by_the_next_run(tmp_path, how):
    """SIGKILL stands for a machine that went away (nothing closes the run: the next command's recovery does),
    SIGTERM for someone stopping it. Either way the next run continues it rather than staging it all again."""
    project = make(tmp_path / "p")
    (project.path / "hang-speed-at.txt").write_text("3")  # baseline 1, a 2, c 3 (b is incorrect, never timed)
    proc = project.spawn("run")
    deadline = time.monotonic() + 120
    while not (project.path / "hanging").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(how)
    proc.communicate(timeout=60)
    (project.path / "hang-speed-at.txt").unlink()

    project.cli("run", check=0)
    first = project.status("--run", "1")
    assert first["run"]["status"] == "interrupted"
    assert steps(first) == {"a": ("kept", None), "b": ("rolled_back", "incorrect"), "c": ("rolled_back", "interrupted")}
    again = project.status()
    assert again["run"]["status"] == "finished"
    assert steps(again) == {"a": ("kept", "already_applied"), "b": ("skipped", "decided_earlier"),
                            "c": ("kept", None), "d": ("kept", None)}
    log = (project.path / "probe-log.txt").read_text()
    assert log.count("correct b\n") == 1  # b was judged once, in the run cut short
    assert tree(project.target) == {"app.txt": b"SPEED = 3\nMODE = plain\n", "c.txt": b"C\n"}
    assert again["final"]["gain"] == pytest.approx(3 * 1.5 - 1)  # against the first run's baseline


def test_a_really_wrong_candidate_is_still_incorrect_when_the_control_passes(tmp_path):
    project = make(tmp_path / "p")
    project.cli("run", "--only", "a,b", check=0)
    data = project.status()
    assert data["run"]["status"] == "finished"
    assert steps(data) == {"a": ("kept", None), "b": ("rolled_back", "incorrect")}
    b = next(s for s in data["steps"] if s["plugin"] == "b")
    assert b["control"] == {"probe": "correct", "passed": True, "reason": None, "detail": "passed (output: checking "
                                                                                          "answers | {\"passed\": true})"}
    assert "the last kept state passes it (control)" in b["detail"]
    assert tree(project.target) == {"app.txt": b"SPEED = 2\nMODE = plain\n"}
    assert "correct passed" in project.cli("status", check=0).stdout


def test_only_restages_a_plugin_the_continued_run_decided(tmp_path):
    project = make(tmp_path / "p")
    (project.path / "break-correct-at.txt").write_text("5")
    project.cli("run", check=1)
    (project.path / "flag").unlink()
    (project.path / "break-correct-at.txt").unlink()
    project.cli("run", "--only", "b", check=0)
    assert steps(project.status()) == {"b": ("rolled_back", "incorrect")}
