"""The vllm target's live path end to end: a real `orchestrator run` whose default probes start
`vllm serve` for every state, where `vllm` on PATH is a stand-in (standin/vllm: the project's engine
server behind vLLM's command line) and the installed vLLM whose options the plugins check is the
real 0.10.2 source."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from vllm_source import OPTIMIZATIONS, REPO, without_sleep_mode

STANDIN = Path(__file__).resolve().parent / "standin" / "vllm"

SERVE = """\
# vllm serve --config: the seed's baseline, on the project's tiny model
model: tiny
dtype: float32
max-num-seqs: 1
max-num-batched-tokens: 8192
max-model-len: 512
kv-cache-memory-bytes: 16777216
"""
CONFIG = """\
target:
  kind: vllm
  package: {package}
  serve_config: serve/serve.yaml
  startup_timeout: 30
  stop_timeout: 3
  check_timeout: 300
  server_timeout: 300
  workload: {{num_prompts: 16, input_len: 32, output_len: 32, max_concurrency: 16, shared_prefix_fraction: 0.5,
             duration: null}}  # a batch: each sample ends when its 16 requests do
  objective: cpu_score  # the server's own CPU time: other load on a shared machine does not stretch it
plugins: plugins
state: state
policy: {policy}
"""
# a 60-second window: a run is still sampling when a test's signal comes, however slow the machine
LONG_WINDOW = CONFIG.replace("duration: null", "duration: 60")
ONE_SAMPLE = "{rule: first, repeats: 1, interleave: false, min_gain: 0.3, min_pairs: 1, max_pairs: 1}"
PLUGIN = """\
id: {id}
description: {id}
order: {order}
targets: [vllm]
apply:
  - yaml_set: {{path: "${{serve_config}}", key: {key}, value: {value}}}
    root: serve
"""
TEST_PLUGINS = {  # id: (order, serve-config key, value)
    "wider-batch": (10, "max-num-seqs", 8),  # a real throughput difference: 8 sequences per step instead of 1
    "bad-value": (20, "max-num-seqs", 0),  # the server rejects it at start
    "other-seed": (30, "seed", 1),  # other weights: every greedy output differs
    "stall": (40, "standin-stall", "true"),  # never answers /health
    "stubborn": (50, "standin-ignore-sigterm", "true"),  # a group member that ignores SIGTERM
    "dies": (60, "standin-exit-after-requests", 12),  # exits mid-sample: 8 greedy requests, then 1 + 16 serving
}
# 0.10.2 has the options of the first two, not the third's, and no fp8_per_tensor among the values of
# --quantization; kv-cache-fp8 declares that it changes numerics
SHIPPED = ("async-scheduling", "kv-cache-fp8", "prefill-cudagraph-tokens", "quantization-fp8")


def standin_env(tmp_path: Path) -> dict[str, str]:
    """`vllm` and the `python3` it runs on PATH first; the repository importable by every process."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, target in (("vllm", STANDIN), ("python3", Path(sys.executable))):
        if not (bin_dir / name).exists():
            (bin_dir / name).symlink_to(target)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STANDIN_DIR": str(tmp_path / "standin"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def left_behind(marker: str) -> list[str]:
    """Live processes whose command line names ``marker`` (the test's folder)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if marker in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(f"{proc.pid}: {cmdline[:200]}")
    return found


@pytest.fixture
def deployment(tmp_path, vllm_pinned):
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "serve.yaml").write_text(SERVE)
    plugins = tmp_path / "plugins"
    for pid, (order, key, value) in TEST_PLUGINS.items():
        (plugins / pid).mkdir(parents=True)
        (plugins / pid / "plugin.yaml").write_text(PLUGIN.format(id=pid, order=order, key=key, value=value))
    for pid in SHIPPED:
        shutil.copytree(OPTIMIZATIONS / pid, plugins / pid)
    (tmp_path / "orchestrator.yaml").write_text(CONFIG.format(package=vllm_pinned, policy=ONE_SAMPLE))
    return tmp_path


def cli(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "--config", "orchestrator.yaml"],
                          cwd=folder, env=standin_env(folder), capture_output=True, text=True, timeout=1500)


def query(folder: Path, sql: str, args: tuple = ()) -> list[dict]:
    db = sqlite3.connect(folder / "state" / "orchestrator.db")
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute(sql, args).fetchall()]
    finally:
        db.close()


def measurements(folder: Path, plugin: str) -> list[dict]:
    return query(folder, "SELECT m.* FROM measurements m LEFT JOIN steps s ON s.id = m.step_id "
                         "WHERE coalesce(s.plugin, 'baseline') = ? ORDER BY m.id", (plugin,))


def server_starts(folder: Path) -> dict[str, list[str]]:
    """{plugin (or "baseline"): the live servers the staging loop started for it, in order}, from the
    processes table, which records each start."""
    starts: dict[str, list[str]] = {}
    for row in query(folder, "SELECT coalesce(s.plugin, 'baseline') AS plugin, p.what FROM processes p "
                             "LEFT JOIN steps s ON s.id = p.step_id WHERE p.what LIKE 'live server%' ORDER BY p.id"):
        starts.setdefault(row["plugin"], []).append(row["what"])
    return starts


def test_live_run_keeps_rolls_back_and_leaves_nothing_behind(deployment):
    run = cli(deployment, "run")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    status = json.loads(cli(deployment, "status", "--json").stdout)
    assert status["run"]["status"] == "finished", status["run"]
    steps = {s["plugin"]: s for s in status["steps"]}

    # the baseline: recorded greedy outputs, measured by the serving benchmark of a live server
    assert json.loads((deployment / "state" / "vllm-reference.json").read_text())["model"] == "tiny"
    assert status["baseline"]["completed"] == 16 and status["baseline"]["score"] > 0
    # kept on a real throughput difference
    wider = steps["wider-batch"]
    assert (wider["outcome"], wider["reason"]) == ("kept", None), wider
    assert wider["gain"] > 0.3
    assert wider["metrics"]["output_tokens_per_cpu_second"] > status["baseline"]["output_tokens_per_cpu_second"]
    # a value the server rejects at start: rolled back, and the run went on
    bad = steps["bad-value"]
    assert bad["outcome"] == "rolled_back" and bad["reason"] in ("crashed", "incorrect"), bad
    assert "exited with code 2" in bad["detail"], bad["detail"]
    # a greedy mismatch
    seed = steps["other-seed"]
    assert (seed["outcome"], seed["reason"]) == ("rolled_back", "incorrect"), seed
    # judged exactly, unless kv-cache-fp8 (before it, and a no-op for speed here) was kept on one sample's noise:
    # then the state declares changed numerics and the greedy probe judges by agreement
    agreement = steps["kv-cache-fp8"]["outcome"] == "kept"
    assert ("diverge from the baseline" if agreement else "differ from the baseline") in seed["detail"], seed
    # a server that never becomes healthy
    stall = steps["stall"]
    assert (stall["outcome"], stall["reason"]) == ("rolled_back", "timeout"), stall
    assert "did not answer /health" in stall["detail"]
    # the option the installed vLLM lacks, read from its source
    graphs = steps["prefill-cudagraph-tokens"]
    assert (graphs["outcome"], graphs["reason"]) == ("skipped", "not_applicable"), graphs
    assert "has no field 'max_prefill_cudagraph_capture_tokens'" in graphs["detail"], graphs["detail"]
    fp8 = steps["quantization-fp8"]
    assert (fp8["outcome"], fp8["reason"]) == ("skipped", "not_applicable"), fp8
    assert "--quantization takes no value 'fp8_per_tensor'" in fp8["detail"]
    # a shipped plugin that sets what the stand-in already defaults to (as vLLM 0.34.0 does): its server resolves
    # the config the kept state's did, so it is rolled back unmeasured
    asynchronous = steps["async-scheduling"]
    assert (asynchronous["outcome"], asynchronous["reason"], asynchronous["decision"]["rule"]) == \
        ("rolled_back", "no_gain", "configuration"), asynchronous
    assert "serving" not in [m["probe"] for m in measurements(deployment, "async-scheduling")]
    # a plugin that declares it changes numerics is judged by agreement, the others exactly
    greedy = {plugin: json.loads(next(m["metrics"] for m in measurements(deployment, plugin)
                                      if m["probe"] == "greedy" and m["arm"] == "candidate"))
              for plugin in ("wider-batch", "kv-cache-fp8")}
    assert (greedy["kv-cache-fp8"]["mode"], greedy["kv-cache-fp8"]["changes_numerics"]) == \
        ("agreement", ["kv-cache-fp8"]), greedy
    assert (greedy["wider-batch"]["mode"], greedy["wider-batch"]["changes_numerics"]) == ("exact", []), greedy
    # a server that ignores SIGTERM is killed, and no probe is blamed for it
    killed = query(deployment, "SELECT e.message, s.plugin FROM events e LEFT JOIN steps s ON s.id = e.step_id "
                               "WHERE e.kind = 'server_killed'")
    # where `stubborn` (a no-op for speed) was kept, the states after it hold its member too
    order = list(steps)
    after = order[order.index("stubborn") + 1:] + ["(final)"] if steps["stubborn"]["outcome"] == "kept" else []
    assert killed and killed[0]["plugin"] == "stubborn" and {k["plugin"] for k in killed} <= {"stubborn", *after}, \
        killed
    assert "did not exit within 3 s of SIGTERM" in killed[0]["message"]
    assert steps["stubborn"]["outcome"] in ("kept", "rolled_back")
    assert steps["stubborn"]["reason"] not in ("crashed", "incorrect", "timeout", "probe_failed")
    # a server that exits mid-sample: crashed, with its exit code; the control's sample starts a server of its own
    dies = steps["dies"]
    assert (dies["outcome"], dies["reason"]) == ("rolled_back", "crashed"), dies
    assert "exited with code 7" in dies["detail"] and dies["control"]["passed"], dies
    assert [(m["arm"], m["ok"]) for m in measurements(deployment, "dies") if m["probe"] == "serving"] == \
        [("candidate", 0), ("control", 1)]

    # one server start per state: the greedy probe and the serving sample share it; a failed start or a failed
    # probe is followed by the control's own start; the final re-validation's pair starts one per arm
    starts = server_starts(deployment)
    assert starts["baseline"] == ["live server (baseline)"]
    for plugin in ("wider-batch", "async-scheduling", "kv-cache-fp8", "stubborn"):
        assert starts[plugin] == ["live server (candidate)"], (plugin, starts)
    for plugin in ("bad-value", "other-seed", "stall", "dies"):
        assert starts[plugin] == ["live server (candidate)", "live server (control)"], (plugin, starts)
    assert starts["(final)"] == ["live server (candidate)", "live server (baseline)"], starts
    assert query(deployment, "SELECT count(*) AS n FROM processes WHERE ended IS NULL")[0]["n"] == 0

    assert left_behind(str(deployment)) == []
    serve = (deployment / "serve" / "serve.yaml").read_text()
    assert "max-num-seqs: 8\n" in serve and "seed:" not in serve and "stall" not in serve
    assert list((deployment / "state" / "server-logs").glob("*.log")), "server logs are kept"


def test_both_probes_share_one_running_server(tmp_path, vllm_pinned):
    """The API the staging loop uses to start one server per state: the target's live server, then
    its default probes aimed at it with --base-url; the probes leave the server running."""
    from orchestrator.config import load

    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "serve.yaml").write_text(SERVE)
    (tmp_path / "plugins").mkdir()
    (tmp_path / "orchestrator.yaml").write_text(CONFIG.format(package=vllm_pinned, policy=ONE_SAMPLE))
    project = load(tmp_path / "orchestrator.yaml")
    env = {**standin_env(tmp_path), "ORCHESTRATOR_PLUGIN": "baseline", **project.target.env()}
    server = project.target.live_server(env, label="shared")
    try:
        server.start().wait_healthy(project.target.config.startup_timeout)
        results = {}
        for spec in project.target.probes_against(server.url, server.pid):
            assert spec["command"][spec["command"].index("--base-url") + 1] == server.url
            argv = [sys.executable, *spec["command"][1:]]
            proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=spec["timeout"])
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
            results[spec["name"]] = json.loads(proc.stdout.splitlines()[-1])
            assert server.exited() is None, "a probe stopped the shared server"
    finally:
        server.stop()
    assert results["greedy"]["passed"] and results["greedy"]["recorded"]
    assert results["serving"]["completed"] == 16 and results["serving"]["cpu_score"] > 0  # the objective here
    assert server.stopped_by == "SIGTERM" and left_behind(str(tmp_path)) == []


def test_paired_samples_reuse_each_arms_server(tmp_path, vllm_pinned):
    """On a vLLM without sleep mode, three pairs in the order C B, B C, C B: the candidate's server serves its
    correctness probe and the first sample, each later server the last sample of one pair and the first of the
    next; every sample of a pair sends that pair's prompts (seed offset by the pair index), none another pair's."""
    package = without_sleep_mode(vllm_pinned, tmp_path / "vllm")
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "serve.yaml").write_text(SERVE)
    (tmp_path / "plugins" / "other-seqs").mkdir(parents=True)
    (tmp_path / "plugins" / "other-seqs" / "plugin.yaml").write_text(
        PLUGIN.format(id="other-seqs", order=10, key="max-num-seqs", value=2))
    # a bar no change clears: rolled back after exactly three pairs, with no final re-validation
    policy = "{repeats: 1, interleave: true, min_pairs: 3, max_pairs: 3, min_gain: 5.0}"
    (tmp_path / "orchestrator.yaml").write_text(CONFIG.format(package=package, policy=policy))
    run = cli(tmp_path, "run")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    step = json.loads(cli(tmp_path, "status", "--json").stdout)["steps"][0]
    assert step["outcome"] == "rolled_back" and step["reason"] in ("no_gain", "regressed", "inconclusive"), step
    starts = server_starts(tmp_path)
    assert starts == {"baseline": ["live server (baseline)"],
                      "other-seqs": ["live server (candidate)", "live server (baseline)",
                                     "live server (candidate)", "live server (baseline)"]}, starts
    samples = [(m["arm"], m["repeat"], json.loads(m["metrics"])) for m in measurements(tmp_path, "other-seqs")
               if m["probe"] == "serving"]
    assert [(arm, pair) for arm, pair, _ in samples] == [("candidate", 0), ("baseline", 0), ("baseline", 1),
                                                         ("candidate", 1), ("candidate", 2), ("baseline", 2)]
    seeds = {(arm, pair): metrics["seed"] for arm, pair, metrics in samples}
    assert all(metrics["pair"] == pair for _, pair, metrics in samples)
    assert [seeds["candidate", i] == seeds["baseline", i] for i in range(3)] == [True] * 3
    assert len({seeds["candidate", i] for i in range(3)}) == 3
    events = [json.loads(line)["event"] for line in (tmp_path / "standin" / "record.jsonl").read_text().splitlines()]
    assert "sleep" not in events and events.count("start") == 5, events  # the servers' own record
    assert left_behind(str(tmp_path)) == []


def start_run(folder: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run", "--config", "orchestrator.yaml"],
                            cwd=folder, env=standin_env(folder), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def recorded(folder: Path) -> bool:
    """Whether the run has recorded a live server in its history yet (none before the database exists)."""
    if not (folder / "state" / "orchestrator.db").exists():
        return False
    try:
        return bool(query(folder, "SELECT id FROM processes WHERE what LIKE 'live server%'"))
    except sqlite3.OperationalError:  # the tables are not created yet
        return False


def wait_until(predicate, run: subprocess.Popen, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert run.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return found


def test_sigterm_to_the_run_stops_its_server_first(tmp_path, vllm_pinned):
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "serve.yaml").write_text(SERVE)
    (tmp_path / "plugins").mkdir()
    (tmp_path / "orchestrator.yaml").write_text(LONG_WINDOW.format(package=vllm_pinned, policy=ONE_SAMPLE))
    run = start_run(tmp_path)
    try:
        # up, and recorded: the run records a server just after it starts it (a SIGTERM between the two stops the
        # server all the same, but leaves no row to assert on)
        wait_until(lambda: any("vllm serve" in p for p in left_behind(str(tmp_path))) and recorded(tmp_path), run,
                   "the live server")
        run.terminate()
        assert run.wait(60) == 1
        # the run stopped its server before it exited: nothing for a recovery to kill
        assert left_behind(str(tmp_path)) == []
        rows = query(tmp_path, "SELECT what, ended FROM processes WHERE what LIKE 'live server%'")
        assert [r["what"] for r in rows] == ["live server (baseline)"] and rows[0]["ended"] is not None
        assert query(tmp_path, "SELECT status FROM runs")[0]["status"] == "interrupted"
        assert (tmp_path / "serve" / "serve.yaml").read_text() == SERVE
    finally:
        if run.poll() is None:
            run.kill()


def test_recover_kills_the_server_of_a_killed_run(tmp_path, vllm_pinned):
    """kill -9 of `orchestrator run` while its live server is up: the kernel's SIGTERM to the server (it asked
    for one when its parent dies) leaves a group member that ignores it; `recover` kills that group."""
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "serve.yaml").write_text(SERVE + "standin-ignore-sigterm: true\n")
    (tmp_path / "plugins").mkdir()
    (tmp_path / "orchestrator.yaml").write_text(LONG_WINDOW.format(package=vllm_pinned, policy=ONE_SAMPLE))
    run = start_run(tmp_path)
    try:
        wait_until(lambda: [p for p in left_behind(str(tmp_path)) if "SIG_IGN" in p] and recorded(tmp_path), run,
                   "the live server")
        assert server_starts(tmp_path) == {"baseline": ["live server (baseline)"]}
        run.kill()
        run.wait(30)
        time.sleep(2)  # the server itself takes the kernel's SIGTERM and exits; the stubborn member stays
        stubborn = [p for p in left_behind(str(tmp_path)) if "SIG_IGN" in p]
        assert stubborn, "the member that ignores SIGTERM outlived the killed run"
        recovered = cli(tmp_path, "recover")
        assert recovered.returncode == 0, recovered.stdout + recovered.stderr
        deadline = time.monotonic() + 10
        while left_behind(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left_behind(str(tmp_path)) == []
        assert query(tmp_path, "SELECT count(*) AS n FROM processes WHERE ended IS NULL")[0]["n"] == 0
        assert query(tmp_path, "SELECT status FROM runs")[0]["status"] == "interrupted"
    finally:
        if run.poll() is None:
            run.kill()
        for line in left_behind(str(tmp_path)):
            psutil.Process(int(line.split(":")[0])).kill()
