"""The real CLI on a files target whose probe has seeded noise and a slow drift: the decisions must hold."""
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

# Each plugin multiplies the probe's speed by its own factor; LEAK only raises memory.
APP = "FAST = 1.00\nNOOP = 1.00\nSLOW = 1.00\nLEAK = 1.00\nMEM = 1000\n"

PROBE = '''
import json, os, random, re
from pathlib import Path
text = (Path(os.environ["ORCHESTRATOR_TARGET_ROOT"]) / "app.txt").read_text()
counter = Path("probe-count.txt")
count = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(count + 1))
rng = random.Random(7000 + count)
speed = 1.0
for name in ("FAST", "NOOP", "SLOW", "LEAK"):
    speed *= float(re.search(name + r" = ([\\d.]+)", text).group(1))
drift = 1 + 0.003 * count          # the machine gets slowly faster: +0.3% per measurement
score = 1000 * speed * drift * rng.gauss(1, 0.02)
mem = float(re.search(r"MEM = (\\d+)", text).group(1))
print(json.dumps({"score": score, "mem_mb": mem}))
'''


def plugin(folder: Path, pid: str, order: int, old: str, new: str, description: str) -> None:
    folder.mkdir(parents=True)
    manifest = {"id": pid, "description": description, "order": order,
                "apply": [{"replace": {"path": "app.txt", "old": old, "new": new, "count": 1}}]}
    (folder / "plugin.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    (root / "target").mkdir()
    (root / "target" / "app.txt").write_text(APP)
    (root / "probe.py").write_text(PROBE)
    plugins = root / "plugins"
    plugin(plugins / "fast", "fast", 10, "FAST = 1.00", "FAST = 1.10", "10% faster")
    plugin(plugins / "noop", "noop", 20, "NOOP = 1.00", "NOOP = 1.000", "changes nothing that matters")
    plugin(plugins / "slow", "slow", 30, "SLOW = 1.00", "SLOW = 0.95", "5% slower")
    plugin(plugins / "leak", "leak", 40, "LEAK = 1.00\nMEM = 1000", "LEAK = 1.30\nMEM = 5000", "faster, leaks memory")
    config = {
        "target": {"kind": "files", "root": "target"}, "plugins": "plugins", "state": "state",
        "probes": [{"name": "speed", "role": "throughput", "command": ["python", "probe.py"], "timeout": 30,
                    "objective": "score"}],
        "policy": {"rule": "stat", "interleave": True, "min_pairs": 3, "max_pairs": 8, "min_gain": 0.02,
                   "confidence": 0.95, "guardrails": {"mem_mb": "<= 2048"}},
    }
    (root / "orchestrator.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    def cli(*args):
        env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
        proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "--config", str(root / "orchestrator.yaml")],
                              cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    cli("run")
    status = json.loads(cli("status", "--json"))
    return root, cli, status, {s["plugin"]: s for s in status["steps"]}


def test_decisions_under_noise_and_drift(finished):
    root, _, _, steps = finished
    outcomes = {p: (s["outcome"], s["reason"]) for p, s in steps.items()}
    assert outcomes["fast"] == ("kept", None)
    assert outcomes["noop"][0] == "rolled_back" and outcomes["noop"][1] in ("no_gain", "inconclusive")
    assert outcomes["slow"][0] == "rolled_back" and outcomes["slow"][1] in ("regressed", "no_gain")
    assert outcomes["leak"] == ("rolled_back", "guardrail")
    fast = steps["fast"]["decision"]
    assert fast["verdict"] == "keep" and fast["ci_low"] > 0.02 and fast["n_candidate"] <= 8
    assert steps["fast"]["gain"] == pytest.approx(0.10, abs=0.04)
    assert steps["leak"]["decision"]["verdict"] == "keep" and "mem_mb" in steps["leak"]["decision"]["vetoes"][0]
    assert (root / "target" / "app.txt").read_text() == APP.replace("FAST = 1.00", "FAST = 1.10")


def test_every_throughput_sample_carries_a_fingerprint(finished):
    root = finished[0]
    conn = sqlite3.connect(root / "state" / "orchestrator.db")
    rows = conn.execute("SELECT fingerprint FROM measurements WHERE role = 'throughput'").fetchall()
    conn.close()
    assert len(rows) >= 3 + 4 * 2 * 3  # the baseline, then at least min_pairs pairs per plugin
    prints = {row[0] for row in rows}
    assert len(prints) == 1 and json.loads(prints.pop())["host"]


def test_report_of_the_run(finished):
    root, cli, status, _ = finished
    out = root / "state" / "reports"
    cli("report", "--out", str(out))
    run_id = status["run"]["id"]
    text = (out / f"run-{run_id}.md").read_text()
    assert "Kept 1, rolled back 3, skipped 0." in text
    assert "guardrail veto: mem_mb" in text
    assert (out / f"run-{run_id}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_implausible_gain_that_holds_is_vetoed_unless_the_plugin_expects_it(tmp_path):
    """A probe reporting 10^300 times the baseline's throughput is re-measured, stays implausible and is vetoed
    (rolled back as a guardrail, saying why); a plugin that declares a large effect (accept: implausible_factor)
    is judged by its interval and kept."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "app.txt").write_text(APP)
    (tmp_path / "probe.py").write_text(PROBE)
    plugin(tmp_path / "plugins" / "absurd", "absurd", 10, "NOOP = 1.00", "NOOP = 1" + "0" * 300 + ".00",
           "a probe that did no work")
    plugin(tmp_path / "plugins" / "big", "big", 20, "FAST = 1.00", "FAST = 5.00", "five times the throughput")
    manifest = tmp_path / "plugins" / "big" / "plugin.yaml"
    manifest.write_text(manifest.read_text() + "accept: {implausible_factor: 10}\n")
    config = {"target": {"kind": "files", "root": "target"}, "plugins": "plugins", "state": "state",
              "probes": [{"name": "speed", "role": "throughput", "command": ["python", "probe.py"], "timeout": 30,
                          "objective": "score"}],
              "policy": {"rule": "stat", "interleave": True, "min_pairs": 3, "max_pairs": 8}}
    (tmp_path / "orchestrator.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    for command in (["run"], ["status", "--json"]):
        proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", *command], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = {s["plugin"]: s for s in json.loads(proc.stdout)["steps"]}
    absurd = steps["absurd"]
    assert (absurd["outcome"], absurd["reason"]) == ("rolled_back", "guardrail"), absurd
    assert absurd["decision"]["n_candidate"] > 3  # re-measured first
    assert "implausible" in absurd["detail"] and "held after re-measuring" in absurd["detail"], absurd["detail"]
    assert (steps["big"]["outcome"], steps["big"]["reason"]) == ("kept", None)
    # the stack holding it, against the baseline, is judged with the effect `big` declares: no re-measuring
    final = json.loads(proc.stdout)["final"]
    assert final["decision"]["n_candidate"] == 3 and "implausible" not in final["detail"], final
    assert (tmp_path / "target" / "app.txt").read_text() == APP.replace("FAST = 1.00", "FAST = 5.00")
