"""The kept stack re-validated against the run's baseline, leave-one-out contributions, staleness and --reverify,
through the real CLI on a files target whose probe has seeded noise."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
A_TXT, B_TXT = "A = 1.00\nC = 1.00\n", "B = 1.00\n"
STACK = {"a.txt": "A = 1.20\nC = 1.10\n", "b.txt": "B = 1.10\n"}

# a: +20% in a.txt; b: +10% in b.txt; c: +10%, also in a.txt, staged after a (so a's share is not separable).
PROBE = '''
import json, os, random, re, time
from pathlib import Path
root = Path(os.environ["ORCHESTRATOR_TARGET_ROOT"])
a, b = (root / "a.txt").read_text(), (root / "b.txt").read_text()
counter = Path("probe-count.txt")
count = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(count + 1))
rng = random.Random(100 + count)
value = lambda text, name: float(re.search(name + r" = ([\\d.]+)", text).group(1))
A, B, C = value(a, "A"), value(b, "B"), value(a, "C")
if os.environ.get("TEST_NO_B"):             # a new environment where b no longer helps
    B = 1.0
if count >= int(os.environ.get("TEST_FADE_AFTER", "999999")):  # a gain that does not last
    A = 1.0
if os.environ.get("TEST_HANG_WITHOUT") and os.environ["ORCHESTRATOR_PLUGIN"] == "(without b)" and B == 1.0:
    Path("marker-hang").write_text(str(os.getpid()))
    time.sleep(120)
print(json.dumps({"score": 1000 * A * B * C * rng.gauss(1, 0.005)}))
'''


def plugin(root: Path, pid: str, order: int, path: str, old: str, new: str) -> None:
    folder = root / "plugins" / pid
    folder.mkdir(parents=True)
    manifest = {"id": pid, "description": f"{old} -> {new}", "order": order,
                "apply": [{"replace": {"path": path, "old": old, "new": new, "count": 1}}]}
    (folder / "plugin.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))


def project(root: Path, plugins=("a", "b", "c")) -> Path:
    (root / "target").mkdir(parents=True)
    (root / "target" / "a.txt").write_text(A_TXT)
    (root / "target" / "b.txt").write_text(B_TXT)
    (root / "probe.py").write_text(PROBE)
    specs = {"a": (10, "a.txt", "A = 1.00", "A = 1.20"), "b": (20, "b.txt", "B = 1.00", "B = 1.10"),
             "c": (30, "a.txt", "C = 1.00", "C = 1.10")}
    for pid in plugins:
        plugin(root, pid, *specs[pid])
    config = {"target": {"kind": "files", "root": "target"}, "plugins": "plugins", "state": "state",
              "probes": [{"name": "speed", "role": "throughput", "command": ["python", "probe.py"], "timeout": 30,
                          "objective": "score"}],
              "policy": {"rule": "stat", "interleave": True, "min_pairs": 3, "max_pairs": 5, "min_gain": 0.02,
                         "repeats": 2}}
    (root / "orchestrator.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return root


def cli(root: Path, *args, env=None, check=0):
    full = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "--config", str(root / "orchestrator.yaml")],
                          cwd=root, env=full, capture_output=True, text=True, timeout=300)
    assert proc.returncode == check, proc.stdout + proc.stderr
    return proc.stdout


def status(root: Path, *args, env=None) -> dict:
    return json.loads(cli(root, "status", "--json", *args, env=env))


def target(root: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((root / "target").iterdir())}


@pytest.fixture(scope="module")
def attributed(tmp_path_factory):
    root = project(tmp_path_factory.mktemp("stack"))
    cli(root, "run", "--attribute")
    return root, status(root)


def test_final_revalidation_measures_the_stack_against_the_runs_baseline(attributed):
    root, data = attributed
    assert [(s["plugin"], s["outcome"]) for s in data["steps"]] == [("a", "kept"), ("b", "kept"), ("c", "kept")]
    final = data["final"]
    assert final["better"] and final["outcome"] == "measured" and final["reason"] is None
    assert final["gain"] == pytest.approx(1.2 * 1.1 * 1.1 - 1, abs=0.03)
    assert final["decision"]["verdict"] == "keep" and final["decision"]["ci_low"] > 0.3
    text = cli(root, "status")
    assert "final re-validation" in text and "NOT better" not in text


def test_attribution_reports_each_contribution_and_leaves_the_stack(attributed):
    root, data = attributed
    shares = {item["plugin"]: item for item in data["attribution"]}
    assert set(shares) == {"a", "b", "c"}
    assert shares["a"]["reason"] == "not_separable" and "c (a.txt)" in shares["a"]["detail"]
    for pid in ("b", "c"):
        assert shares[pid]["gain"] == pytest.approx(0.10, abs=0.03)
        d = shares[pid]["decision"]
        assert d["ci_low"] < shares[pid]["gain"] < d["ci_high"]
    assert target(root) == STACK
    text = cli(root, "status")
    assert "contribution of a: not separable" in text and "contribution of b: +" in text


def test_report_charts_the_revalidation(attributed):
    root, data = attributed
    out = root / "state" / "reports"
    cli(root, "report", "--out", str(out))
    text = (out / f"run-{data['run']['id']}.md").read_text()
    assert "Kept 3, rolled back 0, skipped 0." in text
    assert "the kept stack as a whole beats the run's baseline" in text
    assert "## (final)" in text and "## (without b)" in text


def test_stale_decisions_are_shown_and_reverify_rejudges_them(attributed):
    root, data = attributed
    assert not any(s["stale"] for s in data["steps"])
    moved = {"ORCHESTRATOR_FINGERPRINT_EXTRA": json.dumps({"host": "elsewhere"})}
    stale = status(root, env=moved)
    assert all(s["stale"] and "host" in s["stale_because"] and "elsewhere" in s["stale_because"]
               for s in stale["steps"])
    assert "stale: host" in cli(root, "status", env=moved)
    cli(root, "run", "--reverify", env={**moved, "TEST_NO_B": "1"})
    again = status(root, env=moved)
    steps = {s["plugin"]: s for s in again["steps"]}
    assert (steps["a"]["outcome"], steps["a"]["reason"]) == ("skipped", "not_separable")
    assert steps["b"]["outcome"] == "rolled_back" and steps["b"]["reason"] in ("no_gain", "inconclusive", "regressed")
    assert (steps["c"]["outcome"], steps["c"]["reason"], steps["c"]["stale"]) == ("kept", "reverified", False)
    assert steps["c"]["gain"] == pytest.approx(0.10, abs=0.03)
    assert target(root) == {"a.txt": STACK["a.txt"], "b.txt": B_TXT}
    # the deployment follows: b is gone, c's record is the new step, and rolling everything back restores every byte
    cli(root, "rollback", "--all")
    assert target(root) == {"a.txt": A_TXT, "b.txt": B_TXT}


def test_a_stack_that_is_not_better_is_reported_loudly_and_left_in_place(tmp_path):
    root = project(tmp_path / "p", plugins=("a",))
    cli(root, "run", env={"TEST_FADE_AFTER": "8"})  # 2 baseline samples and 3 pairs see the gain; the stack does not
    data = status(root)
    assert data["steps"][0]["outcome"] == "kept"
    assert not data["final"]["better"] and data["final"]["reason"] == "stack_not_better"
    assert "NOT better than the run's baseline" in cli(root, "status")
    assert target(root)["a.txt"] == "A = 1.20\nC = 1.00\n"


def test_kill_9_during_attribution_then_recover_restores_the_kept_stack(tmp_path):
    root = project(tmp_path / "p")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TEST_HANG_WITHOUT": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run", "--attribute", "--config",
                             str(root / "orchestrator.yaml")], cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    marker = root / "marker-hang"
    deadline = time.monotonic() + 120
    while not (marker.exists() and marker.read_text()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the attribution measurement never started"
    assert target(root)["b.txt"] == B_TXT  # measuring the stack without b
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    cli(root, "recover")
    assert target(root) == STACK
    try:  # recovery killed the probe the dead run left (a zombie until its new parent reaps it)
        assert psutil.Process(int(marker.read_text())).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass
    steps = {s["plugin"]: s for s in status(root)["steps"]}
    assert all(steps[p]["outcome"] == "kept" for p in "abc")


def test_a_bad_fingerprint_override_is_a_clear_error(attributed):
    root, _ = attributed
    out = cli(root, "status", env={"ORCHESTRATOR_FINGERPRINT_EXTRA": "[1, 2]"}, check=1)
    assert out == ""
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "--config", str(root / "orchestrator.yaml")],
                          cwd=root, env={**os.environ, "PYTHONPATH": str(REPO), "ORCHESTRATOR_FINGERPRINT_EXTRA": "{x"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "ORCHESTRATOR_FINGERPRINT_EXTRA: not JSON" in proc.stderr, proc.stderr
