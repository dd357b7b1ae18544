"""A server filled once and measured in turns: the serving probe's `--turns` mode against the real engine server
(paused between windows with its requests kept), and the GPU run's coresident and simultaneous flows on a CPU with
`fill_once`, through the real CLI: one driver per server life, each sample a window of it, nothing left running."""
from __future__ import annotations

import json
import subprocess
import time
from collections import namedtuple

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.probes.client import host_load
from serving_support import PY, REPO, alive_with, env, query, start_server, write_config
from test_live_flow import CONFIG, stage

TURN_ARGS = ["--max-concurrency", "4", "--input-len", "24", "--output-len", "12", "--duration", "1", "--ramp", "0.2"]


def paused(url: str) -> bool:
    return httpx.get(url + "/is_paused", timeout=10).json()["is_paused"]


def held(url: str) -> tuple[float, float]:
    """(requests the server holds, tokens it has generated so far), from its metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    generated = next(v for k, v in values.items() if k.startswith("vllm:generation_tokens"))
    return values["vllm:num_requests_running"] + values["vllm:num_requests_waiting"], generated


def driver(url: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "orchestrator.probes.serving", "--base-url", url, "--turns", *TURN_ARGS,
                             *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env(), cwd=REPO)


def answer(proc: subprocess.Popen) -> dict:
    return json.loads(proc.stdout.readline())


def test_a_server_filled_once_gives_one_window_per_turn_and_waits_paused_between_them(tmp_path):
    server, url = start_server(write_config(tmp_path))
    try:
        proc = driver(url)
        fill = answer(proc)
        assert fill["filled"] and fill["fill_ended"] in ("prefilled", "saturated") and fill["fill_prefilled"] >= 1
        assert paused(url)  # filled, then held until the first window
        windows = []
        for turn in range(3):
            proc.stdin.write("window\n")
            proc.stdin.flush()
            windows.append(answer(proc))
            assert paused(url), turn  # held again between windows, its requests kept where they were
            requests, generated = held(url)
            time.sleep(0.3)
            assert requests >= 1 and held(url) == (requests, generated), turn
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        assert answer(proc) == {"turns": 3}
        assert proc.wait(30) == 0
        assert not paused(url)  # given back running
        assert [w["turn"] for w in windows] == [0, 1, 2]
        for w in windows:
            assert "error" not in w and w["steady_state"] and w["duration"] == 1.0 and w["total_output_tokens"] > 0
            assert w["score"] > 0 and w["tokens_source"] == "server" and w["server_steps"] > 0
            # rated over whole steps, from the first step end after the window opened to the last before its closing
            # reading (a few ms after its end)
            assert 0 < w["rate_seconds"] < w["duration"] + 0.25 and w["output_throughput"] == pytest.approx(
                w["total_output_tokens"] / w["rate_seconds"]), w
            # the machine's load over the window: at least the server's core busy, no more cores than there are
            assert 0 <= w["host_steal"] <= 1 and 0.5 < w["host_busy_cores"] <= psutil.cpu_count(), w
        assert [w["window_started"] for w in windows] == sorted(w["window_started"] for w in windows)
        # the fill is told once, with the first window; the later ones took up the steady state where it was left
        assert windows[0]["fill_prefilled"] == fill["fill_prefilled"] and "fill_seconds" not in windows[1]
    finally:
        server.stop()


def test_the_host_load_of_a_window_counts_busy_cores_and_the_hypervisors_share():
    times = namedtuple("scputimes", "user nice system idle iowait irq softirq steal guest guest_nice")
    before = times(100, 0, 50, 1000, 10, 0, 0, 5, 0, 0)
    # 10 s on 4 cores = 40 s: 12 user + 3 system + 2 softirq busy, 18 idle + 1 iowait, 4 stolen
    after = times(112, 0, 53, 1018, 11, 0, 2, 9, 3, 0)
    load = host_load(before, after, 10.0)
    assert load == pytest.approx({"host_busy_cores": 1.7, "host_steal": 0.1})
    assert host_load(None, after, 10.0) == {} and host_load(before, before, 10.0) == {}


def test_a_driver_given_a_word_it_does_not_know_says_so_and_leaves_the_server_running(tmp_path):
    server, url = start_server(write_config(tmp_path))
    try:
        proc = driver(url)
        assert answer(proc)["filled"]
        proc.stdin.write("measure\n")
        proc.stdin.flush()
        said = answer(proc)
        assert proc.wait(30) == 1
        assert "'measure' is not a command (window, stop)" in said["error"], said
        assert not paused(url)
    finally:
        server.stop()


def test_turns_need_a_running_server_and_a_steady_state():
    proc = subprocess.run([PY, "-m", "orchestrator.probes.serving", "--turns", "--duration", "1"], capture_output=True,
                          text=True, env=env(), cwd=REPO, timeout=60)
    assert proc.returncode == 2 and "--turns needs --base-url" in proc.stderr, proc.stderr


def test_the_gpu_flow_fills_each_server_once_and_samples_it_in_turns(tmp_path):
    """The coresident flow of test_live_flow with `fill_once`: a driver per server, started at its first sample
    and ended before anything else talks to the server (the control re-check) and before the server stops."""
    stage(tmp_path, CONFIG.replace("  arms: coresident\n", "  arms: coresident\n  fill_once: true\n"))
    steps = {s["plugin"]: s for s in query(tmp_path, "SELECT * FROM steps")}
    assert steps["wider-batch"]["outcome"] == "kept", steps["wider-batch"]
    assert (steps["other-weights"]["outcome"], steps["other-weights"]["reason"]) == ("rolled_back", "incorrect")

    procs = query(tmp_path, "SELECT * FROM processes ORDER BY id")
    servers = {p["id"]: p for p in procs if p["what"].startswith("live server")}
    drivers = [p for p in procs if p["what"] == "probe serving (turns)"]
    samples = query(tmp_path, "SELECT * FROM measurements WHERE probe = 'serving' ORDER BY id")
    assert samples and all(s["ok"] for s in samples)
    by_server: dict[int, list[dict]] = {}
    for s in samples:
        by_server.setdefault(s["server"], []).append(json.loads(s["metrics"]))
    # every sample is a turn of a driver on its server; a server's turns count up from its fill, told once each
    for served, windows in by_server.items():
        assert served in servers, served
        turns = [w["turn"] for w in windows]
        assert turns[0] == 0 and all(b in (a + 1, 0) for a, b in zip(turns, turns[1:])), (served, turns)
        assert all(("fill_seconds" in w) == (w["turn"] == 0) for w in windows)
    fills = sum(w["turn"] == 0 for ws in by_server.values() for w in ws)
    assert len(drivers) == fills and len(samples) >= 2 * fills, (len(drivers), fills, len(samples))
    # each driver lived inside a server's life (started after it was healthy, ended before it stopped)
    for d in drivers:
        assert d["ended"] is not None and any(s["ready"] <= d["started"] and d["ended"] <= s["ended"]
                                              for s in servers.values()), (d, servers)
    assert alive_with(str(tmp_path)) == []
    assert query(tmp_path, "SELECT count(*) AS n FROM processes WHERE ended IS NULL")[0]["n"] == 0


def test_simultaneous_servers_filled_once_measure_each_pair_over_the_same_seconds(tmp_path):
    """The GPU's simultaneous flow on a CPU (`arms: simultaneous`, `fill_once`): each server filled once by its
    driver (both drivers started together, so that the warm-ups and fills overlap), both asked for a window at once,
    so that both windows of a pair cover the same seconds; each fresh pair's first windows after the fill are a
    warm-up pair, judged by no one."""
    config = CONFIG.replace("  arms: coresident\n", "  arms: simultaneous\n  fill_once: true\n")
    stage(tmp_path, config)
    steps = {s["plugin"]: s for s in query(tmp_path, "SELECT * FROM steps")}
    assert steps["wider-batch"]["outcome"] == "kept", steps["wider-batch"]
    [calibration] = query(tmp_path, "SELECT * FROM calibrations")
    assert calibration["pairing"] == "simultaneous"
    for step in (s["id"] for s in steps.values() if s["plugin"].startswith("(A/A")):  # one state: both start at once
        servers = {p["what"]: p for p in query(tmp_path, f"SELECT * FROM processes WHERE step_id = {step}")
                   if p["what"].startswith("live server")}
        cand, base = servers["live server (candidate)"], servers["live server (baseline)"]
        assert base["started"] < cand["ready"], servers
    samples = query(tmp_path, "SELECT * FROM measurements WHERE probe = 'serving' ORDER BY id")
    assert samples and all(s["ok"] for s in samples)
    pairs: dict[tuple, dict[str, dict]] = {}
    for s in samples:
        metrics = json.loads(s["metrics"])
        assert "turn" in metrics and 0 <= metrics["host_steal"] <= 1 and metrics["host_busy_cores"] > 0, metrics
        side = s["arm"].replace(" warm-up", "")
        pairs.setdefault((s["step_id"], s["repeat"], s["arm"].endswith("warm-up")), {})[side] = metrics
    judged = [p for (_, _, warm_up), p in pairs.items() if not warm_up and set(p) == {"baseline", "candidate"}]
    warm = [p for (_, _, warm_up), p in pairs.items() if warm_up]
    assert len(judged) >= 4 and warm, sorted(pairs)
    # the first windows after each fill are the warm-ups: every judged window comes after one
    assert all(w["turn"] == 0 and "warmup_seconds" in w for p in warm for w in p.values()), warm
    assert all(w["turn"] > 0 for p in judged for w in p.values()), [
        (k, {a: w["turn"] for a, w in p.items()}) for k, p in pairs.items()
        if not k[2] and len(p) == 2 and min(w["turn"] for w in p.values()) == 0]
    for p in judged + warm:  # asked at once: the windows (1.5 s each) start within a fraction of one
        assert abs(p["baseline"]["window_started"] - p["candidate"]["window_started"]) < 0.5, p
        # measured on one shared core, whichever cores their fills ran on
        assert p["baseline"]["server_cpus"] == p["candidate"]["server_cpus"] and \
            len(p["baseline"]["server_cpus"]) == 1, p
    # the kept state's fresh server started aside: its fill ran on a core of its own, not halving the candidate's
    filled = [p for p in warm if all(w["turn"] == 0 for w in p.values())]
    assert filled and all(p["baseline"]["fill_server_cpus"] != p["candidate"]["fill_server_cpus"]
                          for p in filled), [{a: w["fill_server_cpus"] for a, w in p.items()} for p in filled]
    drivers = [p for p in query(tmp_path, "SELECT * FROM processes") if p["what"] == "probe serving (turns)"]
    assert len(drivers) == sum(w["turn"] == 0 for p in pairs.values() for w in p.values())
    # the candidate's server that served its correctness probe serves its pairs: one start
    for plugin in ("wider-batch",):
        step = steps[plugin]["id"]
        rows = query(tmp_path, f"SELECT * FROM measurements WHERE step_id = {step} AND arm = 'candidate'")
        correct = [r["server"] for r in rows if r["role"] == "correctness"]
        measured = {r["server"] for r in rows if r["role"] == "throughput"}
        assert correct and correct[0] in measured and len(measured) == 1, (plugin, rows)
        started = [d for d in query(tmp_path, f"SELECT * FROM processes WHERE step_id = {step}")
                   if d["what"] == "live server (candidate)"]
        assert len(started) == 1, (plugin, started)
        # started while the configuration probe ran: the start and the probe overlap
        [config] = [d for d in query(tmp_path, f"SELECT * FROM processes WHERE step_id = {step}")
                    if d["what"] == "probe engine-config"]
        assert started[0]["started"] < config["ended"], (started, config)
        # the kept state's fresh server started while the candidate's correctness probe ran on the candidate's
        [correct] = [d for d in query(tmp_path, f"SELECT * FROM processes WHERE step_id = {step}")
                     if d["what"] == "probe engine-correct"]
        [kept] = [d for d in query(tmp_path, f"SELECT * FROM processes WHERE step_id = {step}")
                  if d["what"] == "live server (baseline)"]
        assert started[0]["ready"] <= kept["started"] < correct["ended"], (started, correct, kept)
    # the baseline's server started while its configuration probe ran, as a candidate's does
    early = {p["what"]: p for p in query(tmp_path, "SELECT * FROM processes WHERE step_id IS NULL")}
    assert early["live server (baseline)"]["started"] < early["probe engine-config"]["ended"], early
    # a block's two drivers start together: the second before the first can have warmed up and filled its server
    fresh = [(step, p) for (step, _, _), p in pairs.items()
             if set(p) == {"baseline", "candidate"} and all(w["turn"] == 0 for w in p.values())]
    assert fresh
    for step, p in fresh:
        started = sorted(d["started"] for d in drivers if d["step_id"] == step)
        assert len(started) == 2, (step, started)
        assert started[1] - started[0] < min(w["warmup_seconds"] + w["fill_seconds"] for w in p.values()), (p, started)
    assert alive_with(str(tmp_path)) == []
