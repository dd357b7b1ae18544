"""The vllm target's sleeping pairing end to end: a real `orchestrator run` whose live servers are the stand-in
`vllm` (standin/vllm: the project's engine server behind vLLM's command line, with vLLM's sleep routes and a speed
drawn at each start, ±10%), the installed vLLM whose options the plugins check being the real 0.10.2 source (it has
--enable-sleep-mode). What the servers did is read from their own record (standin/vllm's record.jsonl), not from
the orchestrator's history."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from test_vllm_live import cli, left_behind, measurements, query, server_starts, standin_env
from vllm_source import OPTIMIZATIONS, linked

STEP = 0.15  # seconds of an engine step of several sequences at speed 1 (the stand-in's pace)
SERVE = """\
# vllm serve --config: the tiny model, eight sequences a step; at half the stand-in's speed
model: tiny
dtype: float32
max-num-seqs: 8
max-num-batched-tokens: 8192
max-model-len: 512
kv-cache-memory-bytes: 16777216
standin-speed: 0.5
"""
TARGET = {"kind": "vllm", "serve_config": "serve/serve.yaml", "startup_timeout": 60, "stop_timeout": 5,
          "check_timeout": 300, "server_timeout": 300, "objective": "score",
          "workload": {"num_prompts": 8, "input_len": 16, "output_len": 8, "max_concurrency": 8, "duration": None}}
NO_OPS = 10


def project(tmp: Path, package: Path, plugins: dict[str, dict], policy: dict, serve: str = SERVE) -> Path:
    (tmp / "serve").mkdir()
    (tmp / "serve" / "serve.yaml").write_text(serve)
    for order, (pid, manifest) in enumerate(plugins.items()):
        folder = tmp / "plugins" / pid
        folder.mkdir(parents=True)
        (folder / "plugin.yaml").write_text(yaml.safe_dump({"id": pid, "description": pid, "order": order,
                                                            "targets": ["vllm"], **manifest}))
    (tmp / "plugins").mkdir(exist_ok=True)
    config = {"target": {**TARGET, "package": str(package)}, "plugins": "plugins", "state": "state", "policy": policy}
    (tmp / "orchestrator.yaml").write_text(yaml.safe_dump(config))
    return tmp


def serve_set(key: str, value) -> dict:
    return {"apply": [{"yaml_set": {"path": "${serve_config}", "key": key, "value": value}, "root": "serve"}]}


def run(folder: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The CLI with the stand-in's pace on, its starts counted in the folder (each start's speed drawn from its
    index); it must succeed."""
    result = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "--config", "orchestrator.yaml"],
                            cwd=folder, capture_output=True, text=True, timeout=1500,
                            env={**standin_env(folder), "STANDIN_STARTS": str(folder / "starts.txt"),
                                 "STANDIN_STEP": str(STEP), **env})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def record(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "standin" / "record.jsonl").read_text().splitlines()]


def lives(events: list[dict]) -> dict[int, tuple[float, float]]:
    """{server pid: (its start, its stop or the end of the record)}."""
    end = max(e.get("t", e.get("t1", 0)) for e in events)
    starts = {e["pid"]: e["t"] for e in events if e["event"] == "start"}
    stops = {e["pid"]: e["t"] for e in events if e["event"] == "stop"}
    return {pid: (t, stops.get(pid, end)) for pid, t in starts.items()}


def awake(events: list[dict]) -> dict[int, list[tuple[float, float]]]:
    """{server pid: the spells it was awake}: from its start to its first sleep, from each wake to the next sleep,
    and from the last to its stop (or, for one never recorded stopping, to the end of the record)."""
    end = max(e.get("t", e.get("t1", 0)) for e in events)
    spells: dict[int, list[tuple[float, float]]] = {}
    since: dict[int, float | None] = {}
    for e in sorted((e for e in events if e["event"] != "completion"), key=lambda e: e["t"]):
        pid = e["pid"]
        if e["event"] in ("start", "wake"):
            since[pid] = e["t"]
        elif since.get(pid) is not None:  # a sleep or a stop ends an awake spell
            spells.setdefault(pid, []).append((since[pid], e["t"]))
            since[pid] = None
    for pid, t in since.items():
        if t is not None:
            spells.setdefault(pid, []).append((t, end))
    return spells


def test_sleeping_servers_keep_a_real_gain_and_not_the_no_ops(tmp_path, vllm_pinned):
    """Ten serve options the stand-in ignores, a state twice as fast, a change of weights declared as changing
    numerics, and a plugin that patches the package, judged after an A/A calibration of the sleeping pairing: the
    real gain kept, at most one no-op; the kept state's server woken for its samples, never awake beside another;
    the greedy outputs checked on every server after its start and after its first wake."""
    package = linked(vllm_pinned, tmp_path / "vllm")
    plugins = {"faster": serve_set("standin-speed", 1.0)}
    plugins.update({f"no-op-{i}": serve_set("stream-interval", i + 2) for i in range(NO_OPS)})
    plugins["other-weights"] = {**serve_set("seed", 1), "changes_numerics": True}
    plugins["patch-package"] = {
        "apply": [{"command": {"run": ["python3", "-c", "import os, time; open(os.environ['STANDIN_DIR'] + "
                                                         "'/applied', 'w').write(repr(time.time()))"]},
                   "root": "serve"},
                  {"deploy": {"src": "note.txt", "dest": "orchestrator-note.txt"}}],
        "accept": {"min_pairs": 1, "max_pairs": 1}}
    policy = {"repeats": 1, "min_gain": 0.03, "min_pairs": 2, "max_pairs": 4, "max_starts": 1,
              "calibrate": {"starts": 4, "pairs": 2}}
    folder = project(tmp_path, package, plugins, policy)
    (folder / "plugins" / "patch-package" / "note.txt").write_text("a file the package never had\n")
    run(folder, "run")
    status = json.loads(cli(folder, "status", "--json").stdout)
    assert status["run"]["status"] == "finished", status["run"]
    steps = {s["plugin"]: s for s in status["steps"]}

    # the calibration ran in the sleeping pairing and found woken servers measuring as they did
    calibration = status["calibration"]
    assert calibration["pairing"] == "sleeping" and calibration["wake"]["like_fresh"], calibration
    assert calibration["wake"]["woken"] >= 2 and calibration["wake"]["same"] >= 2
    # each block's fresh candidate: its first sample, after the probe's warm-up, against its next
    assert calibration["first_window"]["servers"] >= 3, calibration
    # the real gain kept, at most one of the ten no-ops, each decision with an interval counting the start effects
    # the calibration found. The stand-in's ±10% per start is about its timing noise on a busy machine, so 4 blocks
    # of 2 pairs put the estimate of the spread between starts at 0 in a quarter to a third of runs (method of
    # moments on 3 degrees of freedom); the decisions then count none, and must say so.
    assert steps["faster"]["outcome"] == "kept", steps["faster"]
    kept = [p for p in plugins if p.startswith("no-op") and steps[p]["outcome"] == "kept"]
    assert len(kept) <= NO_OPS // 10, kept
    for pid in ["faster", *(p for p in plugins if p.startswith("no-op"))]:
        decision = steps[pid]["decision"]
        assert decision["ci_low"] is not None and decision["between"] == (calibration["between"] or None), \
            (pid, decision, calibration["between"])
    # a numerics-changing plugin is judged by agreement: every output differs, so it is incorrect
    weights = steps["other-weights"]
    assert (weights["outcome"], weights["reason"]) == ("rolled_back", "incorrect"), weights
    greedy = json.loads(next(m["metrics"] for m in measurements(folder, "other-weights")
                             if m["probe"] == "greedy" and m["arm"] == "candidate"))
    assert (greedy["mode"], greedy["changes_numerics"], greedy["passed"]) == ("agreement", ["other-weights"], False)
    assert weights["control"]["passed"], weights

    # one server start per no-op candidate: the kept state's server lived on, asleep, from one to the next
    starts = server_starts(folder)
    for pid in (p for p in plugins if p.startswith("no-op")):
        assert starts[pid] == ["live server (candidate)"], (pid, starts)
        greedy = [m["arm"] for m in measurements(folder, pid) if m["probe"] == "greedy"]
        assert greedy.count("candidate") == 2, (pid, greedy)  # after its start, after its first wake

    # the servers' own record: never two awake at once; every completion served by an awake server
    events = record(folder)
    spells = awake(events)
    flat = sorted((a, b, pid) for pid, ss in spells.items() for a, b in ss)
    for (a0, b0, p0), (a1, b1, p1) in zip(flat, flat[1:]):
        assert a1 >= b0, f"server {p1} awake at {a1:.3f} while {p0} was awake until {b0:.3f}"
    for e in (e for e in events if e["event"] == "completion"):
        assert any(a <= e["t0"] and e["t1"] <= b for a, b in spells[e["pid"]]), e
    wakes = [e for e in events if e["event"] == "wake"]
    assert len(wakes) >= 2 * NO_OPS, len(wakes)
    # the server that served the no-ops' kept arm was woken for them, again and again
    kept_server = max({e["pid"] for e in wakes}, key=lambda pid: sum(e["pid"] == pid for e in wakes))
    assert sum(e["pid"] == kept_server for e in wakes) >= NO_OPS

    # a plugin that patches the package: the kept state's server is stopped before its first step runs, and its
    # comparison starts a server per arm, one at a time
    applied = float((folder / "standin" / "applied").read_text())
    alive_then = [pid for pid, (a, b) in lives(events).items() if a <= applied <= b]
    assert alive_then == [], alive_then
    stopped = {e["pid"] for e in events if e["event"] == "stop" and e["t"] <= applied}
    assert kept_server in stopped
    assert starts["patch-package"] == ["live server (candidate)", "live server (baseline)"], starts
    assert not (package / "orchestrator-note.txt").exists()

    assert query(folder, "SELECT count(*) AS n FROM processes WHERE ended IS NULL")[0]["n"] == 0
    assert left_behind(str(folder)) == []


def test_a_wake_that_moves_a_server_like_a_fresh_start_turns_the_run_to_restarts(tmp_path, vllm_pinned):
    """A stand-in whose speed is drawn anew at each wake (as a fresh start's is): `orchestrator calibrate` shows the
    wake's effect and says woken servers do not measure like fresh ones; a run then restarts servers at each
    switch of arm and says why."""
    serve = SERVE.replace("standin-speed: 0.5\n", "standin-wake-redraws: true\n")
    folder = project(tmp_path, vllm_pinned, {"other-seqs": serve_set("max-num-seqs", 4)},
                     {"repeats": 1, "min_gain": 0.03, "min_pairs": 1, "max_pairs": 1}, serve=serve)
    # the redraws are seeded: at +-50%, most wakes move a server well past the few percent a busy 2-core machine
    # adds to each sample, and 4 starts give 11 differences across a wake (3 starts at +-30% gave p = 0.03-0.054)
    out = run(folder, "calibrate", "--starts", "4", "--pairs", "3", STANDIN_SPREAD="0.5").stdout
    assert "woken servers do NOT measure like the servers they were" in out, out
    [calibration] = query(folder, "SELECT * FROM calibrations")
    wake = json.loads(calibration["summary"])["wake"]
    assert calibration["pairing"] == "sleeping" and not wake["like_fresh"] and wake["p"] < 0.05, wake
    assert wake["spread"] > calibration["between_sd"] / 2

    run(folder, "run", STANDIN_SPREAD="0.5")
    warnings = [e["message"] for e in query(folder, "SELECT * FROM events WHERE kind = 'warning'")]
    assert any("servers are restarted at each switch of arm instead" in w for w in warnings), warnings
    run_id = query(folder, "SELECT max(id) AS id FROM runs")[0]["id"]
    starts = [r["what"] for r in query(folder, "SELECT p.what FROM processes p JOIN steps s ON s.id = p.step_id "
                                               "WHERE p.what LIKE 'live server%' AND s.run_id = ? "
                                               "AND s.plugin = 'other-seqs' ORDER BY p.id", (run_id,))]
    assert starts == ["live server (candidate)", "live server (baseline)"], starts  # asleep, the kept one would wake
    assert not [e for e in record(folder) if e["event"] in ("sleep", "wake") and e["t"] > calibration["at"]]


def test_a_serve_environment_plugin_reaches_its_servers_alone_and_leaves_nothing(tmp_path, vllm_newest):
    """The shipped torch-compile (VLLM_USE_BREAKABLE_CUDAGRAPH=0 in serve-env.yaml; the newest vLLM's source reads
    the variable): only its candidate's server starts with it, the configuration probe sees it (measured, not
    rolled back unmeasured), greedy outputs are judged by agreement, and once it is rolled back the file is gone and
    the next server starts without it. A plugin that writes a value no environment holds fails alone, naming the
    file and the key."""
    package = linked(vllm_newest, tmp_path / "vllm")
    env_set = {"apply": [{"yaml_set": {"path": "serve-env.yaml", "key": "VLLM_TRACE_FUNCTION", "value": True},
                          "root": "serve"}]}
    plugins = {"bool-env": env_set, "then-no-op": {**serve_set("stream-interval", 3), "order": 90}}
    policy = {"rule": "first", "repeats": 1, "interleave": False, "min_gain": 0.3, "min_pairs": 1, "max_pairs": 1}
    folder = project(tmp_path, package, plugins, policy)
    shutil.copytree(OPTIMIZATIONS / "torch-compile", folder / "plugins" / "torch-compile")
    serve_before = (folder / "serve" / "serve.yaml").read_bytes()
    run(folder, "run")
    status = json.loads(cli(folder, "status", "--json").stdout)
    assert status["run"]["status"] == "finished", status["run"]
    steps = {s["plugin"]: s for s in status["steps"]}
    assert list(steps) == ["bool-env", "torch-compile", "then-no-op"]

    bad = steps["bool-env"]
    assert bad["outcome"] == "rolled_back", bad
    assert "serve-env.yaml: VLLM_TRACE_FUNCTION: the value must be a string or an integer, not True" in bad["detail"]
    compiled = steps["torch-compile"]
    assert compiled["outcome"] == "rolled_back" and compiled["reason"] in ("no_gain", "inconclusive"), compiled
    assert compiled["decision"]["rule"] != "configuration", compiled  # its server resolved other settings
    greedy = [json.loads(m["metrics"]) for m in measurements(folder, "torch-compile")
              if m["probe"] == "greedy" and m["arm"] == "candidate"]
    assert greedy and all((g["mode"], g["changes_numerics"]) == ("agreement", ["torch-compile"]) for g in greedy)

    starts = [e for e in record(folder) if e["event"] == "start"]
    with_it = [i for i, e in enumerate(starts) if e["env"].get("VLLM_USE_BREAKABLE_CUDAGRAPH") == "0"]
    assert with_it and all("VLLM_TRACE_FUNCTION" not in e["env"] for e in starts)
    assert len(starts) > with_it[-1] + 1  # then-no-op's server, after the rollback: without it
    assert all("VLLM_USE_BREAKABLE_CUDAGRAPH" not in e["env"] for e in starts[with_it[-1] + 1:])
    assert all(e["env"].get("VLLM_SERVER_DEV_MODE") == "1" for e in starts)
    assert not (folder / "serve" / "serve-env.yaml").exists()
    assert (folder / "serve" / "serve.yaml").read_bytes() == serve_before
    assert left_behind(str(folder)) == []
