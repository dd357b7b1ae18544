"""Screening on Ray workers through the real CLI: a files target whose server and probes say they run on a GPU, on a
local Ray cluster of this module declaring two fake GPUs (Ray sets each worker's CUDA_VISIBLE_DEVICES), with a
deterministic throughput probe. Workers decide as one worker does, only the run writes its history, a worker killed
mid-sample costs nothing but time, and one worker never imports Ray."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml

from core_project import FIXTURES, REPO, Project, ended, tree

ORIGINAL = {"app.txt": b"SPEED = 1\nLATENCY = 10\nMODE = plain\n"}

CORRECT = '''
import json, os
from pathlib import Path
text = (Path(os.environ["ORCHESTRATOR_TARGET_ROOT"]) / "app.txt").read_text()
print(json.dumps({"passed": "MODE = BROKEN" not in text}))
'''
# score = 100 x SPEED, exactly. Each run is logged with the devices it saw and its parent (the worker that ran
# it); with `gpu-1-fails` every run on GPU 1 fails; in MODE = KILLWORKER the first run names its parent in
# `kill-me` and waits to be killed with it.
SPEED = '''
import json, os, re, time
from pathlib import Path
here = Path(__file__).parent
root = Path(os.environ["ORCHESTRATOR_TARGET_ROOT"])
text = (root / "app.txt").read_text()
with open(here / "probe-log.txt", "a") as log:
    log.write(json.dumps({"plugin": os.environ["ORCHESTRATOR_PLUGIN"], "root": str(root), "parent": os.getppid(),
                          "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\\n")
if os.environ.get("CUDA_VISIBLE_DEVICES") == "1" and (here / "gpu-1-fails").exists():
    print("CUDA error: an illegal memory access was encountered", flush=True)
    raise SystemExit(3)
if "MODE = KILLWORKER" in text and not (here / "kill-me").exists():
    (here / "kill-me.tmp").write_text(str(os.getppid()))
    os.rename(here / "kill-me.tmp", here / "kill-me")
    time.sleep(60)
speed = float(re.search(r"SPEED = (\\d+)", text).group(1))
print(json.dumps({"score": 100 * speed, "start_at": float(os.environ.get("ORCHESTRATOR_START_AT", 0))}))
'''
TUNE = {"id": "tune", "params": {"speed": [2, 5, 3, 1]},
        "apply": [{"replace": {"path": "app.txt", "old": "SPEED = 1", "new": "SPEED = ${speed}"}}]}
# a command step: on a worker it runs in the worker's copy, under a keeper recording there what it changed
LATENCY = {"id": "latency", "apply": [{"command": {"run": [
    "python", "-c", "import pathlib; p = pathlib.Path('app.txt'); "
                    "p.write_text(p.read_text().replace('LATENCY = 10', 'LATENCY = 5'))"]}}]}
NEEDS_TUNE = {"id": "needs-tune", "requires": ["tune"],
              "apply": [{"replace": {"path": "app.txt", "old": "MODE = plain", "new": "MODE = fast"}}]}
STALL = {"id": "stall", "apply": [{"replace": {"path": "app.txt", "old": "MODE = plain", "new": "MODE = KILLWORKER"}}]}
POLICY = {"interleave": True, "min_pairs": 2, "max_pairs": 3, "repeats": 2, "implausible_factor": 10}


def make(path: Path, plugins: list[dict], **policy) -> Project:
    (path / "target").mkdir(parents=True)
    for name, data in ORIGINAL.items():
        (path / "target" / name).write_bytes(data)
    (path / "correct.py").write_text(CORRECT)
    (path / "speed.py").write_text(SPEED)
    for manifest in plugins:
        (path / "plugins" / manifest["id"]).mkdir(parents=True)
        (path / "plugins" / manifest["id"] / "plugin.yaml").write_text(yaml.safe_dump(manifest))
    config = {"target": {"kind": "files", "root": "target", "gpu": True}, "plugins": "plugins", "state": "state",
              "probes": [{"name": "correct", "role": "correctness", "command": ["python", "correct.py"], "timeout": 30},
                         {"name": "speed", "role": "throughput", "command": ["python", "speed.py"], "timeout": 30,
                          "objective": "score"}],
              "policy": {**POLICY, **policy}}
    (path / "orchestrator.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return Project(path)


@pytest.fixture(scope="module")
def cluster():
    """One local cluster for the module (a start costs seconds): two CPUs and two GPUs, which are only declared."""
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def decisions(project: Project) -> dict[tuple, tuple]:
    """{(plugin, params): (outcome, reason)} of the latest run: a combination's attempt on the target, else what
    its worker decided."""
    out: dict[tuple, tuple] = {}
    for s in sorted(project.status()["steps"], key=lambda s: s.get("kind") == "screening"):
        key = (s["plugin"], json.dumps(s["params"], sort_keys=True))
        out.setdefault(key, (s["outcome"], s["reason"]))
    return out


def probes(project: Project) -> list[dict]:
    return [json.loads(line) for line in (project.path / "probe-log.txt").read_text().splitlines()]


def screening_samples(project: Project) -> list[dict]:
    with project.db() as db:
        return [dict(r) for r in db.execute(
            "SELECT m.step_id, m.arm, m.repeat, m.worker, m.metrics FROM measurements m JOIN steps s ON s.id = "
            "m.step_id WHERE s.kind = 'screening' AND m.role = 'throughput' ORDER BY m.id")]


def test_a_params_search_on_two_workers_decides_as_one_worker_does(tmp_path, cluster):
    one = make(tmp_path / "one", [TUNE, LATENCY, NEEDS_TUNE])
    two = make(tmp_path / "two", [TUNE, LATENCY, NEEDS_TUNE])
    one.cli("run", check=0)
    out = two.cli("run", "--workers", "2", "--ray-address", cluster, check=0).stdout

    assert decisions(two) == decisions(one)
    assert decisions(one)[("tune", '{"speed": 5}')] == ("kept", None)
    assert tree(two.target) == tree(one.target)
    data = two.status()
    screened = [s for s in data["steps"] if s.get("kind") == "screening"]
    # the four combinations and `latency` (independent of `tune`) were screened; `needs-tune` waited for `tune`
    assert sorted((s["plugin"], s["params"]["speed"] if s["params"] else None) for s in screened) == [
        ("latency", None), ("tune", 1), ("tune", 2), ("tune", 3), ("tune", 5)]
    assert {w for s in screened for w in s["workers"]} == {"w1 (GPU 0)", "w2 (GPU 1)"}
    # each worker's probes saw the one GPU Ray gave it, in its own copy of the target; the run's saw none
    runs = probes(two)
    on_workers = [r for r in runs if r["root"] != str(two.target)]
    assert on_workers and {r["devices"] for r in on_workers} == {"0", "1"}
    assert all(r["root"].startswith(str(two.state / "screening")) for r in on_workers)
    assert {r["devices"] for r in runs if r["root"] == str(two.target)} == {os.environ.get("CUDA_VISIBLE_DEVICES")}
    assert data["screening"]["candidates"] == 5 and data["screening"]["workers"] == 2
    assert "screening: 5 candidates" in out and "w1 (GPU 0)" in out
    assert not (two.state / "screening").exists()  # every worker's folder is gone once recorded
    assert ended(two, 10)
    two.cli("report", "--out", str(tmp_path / "report"), check=0)
    report = (tmp_path / "report" / f"run-{data['run']['id']}.md").read_text()
    assert "Screening: 5 candidates" in report and "- candidate on w1 (GPU 0) samples: " in report


def test_the_run_alone_opens_its_history(tmp_path, cluster):
    project = make(tmp_path / "p", [TUNE, LATENCY])
    log = tmp_path / "opened.txt"
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(FIXTURES / "audit")]), "TEST_OPEN_LOG": str(log)}
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run", "--workers", "2", "--ray-address",
                             cluster, "--config", str(project.config)], cwd=project.path,
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    opened = [line.split(" ", 1) for line in log.read_text().splitlines()]
    history = str(project.state / "orchestrator.db")
    by = {int(pid) for pid, db in opened if db.removeprefix("file:").split("?")[0] == history}
    workers = {int(pid) for pid, db in opened if "/screening/" in db}
    assert by == {proc.pid}
    assert len(workers) == 2 and proc.pid not in workers  # the workers kept histories of their own, and only those
    assert {r["parent"] for r in probes(project) if r["root"] != str(project.target)} == workers


def test_a_worker_killed_mid_sample_costs_its_candidate_a_control_and_the_target_decides(tmp_path, cluster):
    project = make(tmp_path / "p", [{**TUNE, "params": {"speed": [2, 3]}}, STALL])
    proc = project.spawn("run", "--workers", "2", "--ray-address", cluster)
    kill_me = project.path / "kill-me"
    deadline = time.monotonic() + 120
    while not kill_me.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "no marker"
        time.sleep(0.02)
    worker = int(kill_me.read_text())
    os.kill(worker, signal.SIGKILL)  # the worker dies while its probe takes a sample
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out

    steps = project.status()["steps"]
    stall = [s for s in steps if s["plugin"] == "stall"]
    assert [(s.get("kind", "attempt"), s["outcome"], s["reason"]) for s in stall] == [
        ("screening", "rolled_back", "environment_failed"), ("attempt", "rolled_back", "no_gain")]
    died = stall[0]
    assert "failed under it" in died["detail"]
    control = died["control"]
    assert control["passed"] and control["worker"] not in died["detail"]  # re-checked on the other worker
    # never a wrong keep: only the best combination is kept, judged on the target
    assert {(s["plugin"], json.dumps(s["params"])) for s in steps if s["outcome"] == "kept"} == {
        ("tune", '{"speed": 3}')}
    assert (project.target / "app.txt").read_text() == "SPEED = 3\nLATENCY = 10\nMODE = plain\n"
    assert ended(project, 10)  # the dead worker's sleeping probe was ended with it
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)


def test_a_worker_whose_gpu_fails_is_checked_on_another_and_retired(tmp_path, cluster):
    one = make(tmp_path / "one", [TUNE, LATENCY])
    two = make(tmp_path / "two", [TUNE, LATENCY])
    (two.path / "gpu-1-fails").write_text("")
    one.cli("run", check=0)
    two.cli("run", "--workers", "2", "--ray-address", cluster, check=0)

    assert decisions(two) == decisions(one)
    screened = [s for s in two.status()["steps"] if s.get("kind") == "screening"]
    failed = [s for s in screened if s["reason"] == "environment_failed"]
    assert len(failed) == 1 and "w2 (GPU 1)" in failed[0]["detail"]
    assert "fails on the last kept state too" in failed[0]["detail"]  # its own control failed on GPU 1
    assert failed[0]["control"]["passed"] and failed[0]["control"]["worker"] == "w1 (GPU 0)"
    # once it failed, the worker took no more candidates; the one it failed was staged on the target
    assert all(s["workers"] == ["w1 (GPU 0)"] for s in screened if s is not failed[0])
    plugin, params = failed[0]["plugin"], failed[0]["params"]
    assert any(s.get("kind") is None and s["plugin"] == plugin and s["params"] == params for s in
               two.status()["steps"])


def test_a_run_stopped_while_its_workers_screen_is_recorded_interrupted_and_leaves_nothing_running(tmp_path,
                                                                                                    cluster):
    project = make(tmp_path / "p", [{**TUNE, "params": {"speed": [2, 3]}}, STALL])
    proc = project.spawn("run", "--workers", "2", "--ray-address", cluster)
    deadline = time.monotonic() + 120
    while not (project.path / "kill-me").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)  # while the run waits for its workers
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "interrupted" in out, out
    data = project.status()
    assert data["run"]["status"] == "interrupted"
    assert all(s["state"] == "done" for s in data["steps"])
    assert (project.target / "app.txt").read_bytes() == ORIGINAL["app.txt"]
    assert ended(project, 10)


def test_a_duet_measures_the_kept_state_and_the_candidate_on_both_workers_in_turn(tmp_path, cluster):
    one = make(tmp_path / "one", [TUNE, LATENCY])
    duet = make(tmp_path / "duet", [TUNE, LATENCY], workers=2, duet=True)
    one.cli("run", check=0)
    duet.cli("run", "--ray-address", cluster, check=0)

    assert decisions(duet) == decisions(one)
    samples = screening_samples(duet)
    assert samples
    by_pair: dict[tuple, dict[str, dict]] = {}
    for m in samples:
        by_pair.setdefault((m["step_id"], m["repeat"]), {})[m["arm"]] = m
    for (step, n), arms in by_pair.items():
        base, cand = arms["baseline"], arms["candidate"]
        assert {base["worker"], cand["worker"]} == {"w1 (GPU 0)", "w2 (GPU 1)"}
        # the leader (w1) measures the kept state at even pairs and the candidate at odd ones
        assert base["worker"] == ("w1 (GPU 0)" if n % 2 == 0 else "w2 (GPU 1)")
        assert json.loads(base["metrics"])["start_at"] == json.loads(cand["metrics"])["start_at"] > 0


def test_one_worker_never_imports_ray_and_two_do(tmp_path, cluster):
    project = make(tmp_path / "p", [TUNE], workers=1)
    loaded = tmp_path / "modules.txt"
    code = ("import atexit, sys\n"
            f"atexit.register(lambda: open({str(loaded)!r}, 'w').write(str('ray' in sys.modules)))\n"
            "from orchestrator.cli import app\napp()\n")

    def run(*args):
        return subprocess.run([sys.executable, "-c", code, "run", "--config", str(project.config), *args],
                              cwd=project.path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                              text=True, timeout=300)
    first = run()
    assert first.returncode == 0, first.stdout + first.stderr
    assert loaded.read_text() == "False"
    second = run("--workers", "2", "--ray-address", cluster)
    assert second.returncode == 0, second.stdout + second.stderr
    assert loaded.read_text() == "True"


WITHOUT_RAY = "import sys\nsys.modules['ray'] = None\nfrom orchestrator.cli import app\napp()\n"  # as if not installed


@pytest.mark.parametrize("policy, args, without_ray, says", [
    ({"workers": 0}, [], False, "policy.workers: Input should be greater than or equal to 1"),
    ({}, ["--workers", "0"], False, "'--workers'"),
    ({}, ["--workers", "2"], True, "command line: --workers: 2 workers run on Ray, which cannot be imported"),
    ({"workers": 3}, [], True, "orchestrator.yaml: policy.workers: 3 workers run on Ray"),
    ({}, ["--workers", "2", "--ray-address", "127.0.0.1:1"], False, "command line: --ray-address: nothing answers"),
    ({}, ["--workers", "2", "--ray-address", "head-node"], False, "--ray-address: 'head-node' is not HOST:PORT"),
    ({"duet": True}, [], False, "policy.duet: a duet measures each candidate on two workers; policy.workers is 1"),
])
def test_bad_worker_settings_change_nothing(tmp_path, policy, args, without_ray, says):
    project = make(tmp_path / "p", [TUNE], **policy)
    before = tree(project.path)
    code = WITHOUT_RAY if without_ray else "from orchestrator.cli import app\napp()\n"
    proc = subprocess.run([sys.executable, "-c", code, "run", "--config", str(project.config), *args],
                          cwd=project.path, env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in " ".join(proc.stderr.split()), proc.stderr
    assert tree(project.path) == before and not project.state.exists()


def test_more_workers_than_the_cluster_has_gpus_change_nothing(tmp_path, cluster):
    project = make(tmp_path / "p", [TUNE])
    before = tree(project.path)
    proc = project.cli("run", "--workers", "3", "--ray-address", cluster)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"command line: --workers: 3 workers need 3 GPUs; the Ray cluster at {cluster} has 2" in \
        " ".join(proc.stderr.split())
    assert tree(project.path) == before and not project.state.exists()


def test_a_plugin_cannot_ask_for_workers_of_its_own(tmp_path):
    project = make(tmp_path / "p", [{**TUNE, "accept": {"workers": 2}}])
    before = tree(project.path)
    proc = project.cli("run")
    assert proc.returncode == 2 and "accept.workers" in proc.stderr, proc.stderr
    assert tree(project.path) == before
