"""Simultaneous arms on the CPU engine target, through the real CLI: one live server per arm, both alive for the
whole comparison and measured on one shared core (the kept state's started aside on a core of its own), a warm-up
pair first, and each pair's two serving probes
measuring at the same time from one agreed instant."""
from __future__ import annotations

import json
import os

import pytest

from orchestrator.config import load
from serving_support import STAGED_CONFIG, alive_with, query, stage_wider_batch

def test_both_arms_are_measured_at_once_on_servers_that_live_through_the_comparison(tmp_path):
    run = stage_wider_batch(tmp_path, "simultaneous")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    steps = {s["plugin"]: s for s in query(tmp_path, "SELECT * FROM steps")}
    assert steps["wider-batch"]["outcome"] == "kept", steps["wider-batch"]

    procs = query(tmp_path, "SELECT coalesce(s.plugin, 'baseline') AS plugin, p.what, p.started, p.ended "
                            "FROM processes p LEFT JOIN steps s ON s.id = p.step_id ORDER BY p.id")
    servers = [(p["plugin"], p["what"]) for p in procs if p["what"].startswith("live server")]
    # the baseline's samples share one server; each comparison starts one per arm, the candidate's first
    assert servers == [("baseline", "live server (baseline)"),
                       ("wider-batch", "live server (candidate)"), ("wider-batch", "live server (baseline)"),
                       ("(final)", "live server (candidate)"), ("(final)", "live server (baseline)")]
    for plugin in ("wider-batch", "(final)"):
        mine = [p for p in procs if p["plugin"] == plugin]
        cand, base = (next(p for p in mine if p["what"] == f"live server ({arm})") for arm in ("candidate", "baseline"))
        probes = [p for p in mine if p["what"].startswith("probe serving (")]
        assert len(probes) == 6  # a warm-up pair and two judged pairs, one probe per arm each
        # both servers were up before the first probe and stopped after the last
        assert max(cand["started"], base["started"]) < min(p["started"] for p in probes)
        assert min(cand["ended"], base["ended"]) >= max(p["ended"] for p in probes)

    samples = query(tmp_path, "SELECT s.plugin, m.arm, m.repeat, m.metrics FROM measurements m "
                              "JOIN steps s ON s.id = m.step_id WHERE m.probe = 'serving' ORDER BY m.id")
    for plugin in ("wider-batch", "(final)"):
        by_pair: dict[int, dict[str, dict]] = {}
        for m in samples:
            if m["plugin"] == plugin:
                by_pair.setdefault(m["repeat"], {})[m["arm"]] = json.loads(m["metrics"])
        assert sorted(by_pair) == [0, 1, 100]
        assert set(by_pair[100]) == {"candidate warm-up", "baseline warm-up"}  # fresh servers' first pair
        del by_pair[100]
        for pair, arms in by_pair.items():
            cand, base = arms["candidate"], arms["baseline"]
            assert cand["pair"] == base["pair"] == pair and cand["seed"] == base["seed"]  # the same prompts
            # each window began at the agreed instant, give or take the event loop
            assert 0 <= cand["start_lag_seconds"] < 0.5 and 0 <= base["start_lag_seconds"] < 0.5
            assert cand["cpu_score"] > 0 and base["cpu_score"] > 0
            assert cand["base_url"] != base["base_url"]
    logs = sorted((tmp_path / "state" / "server-logs").glob("run1-wider-batch-*.log"))
    if len(os.sched_getaffinity(0)) > 1:
        # the candidate's server starts on the shared core, the kept state's aside on a core of its own; both
        # are measured on the shared one
        first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
        argv = {arm: next(log.read_text().splitlines()[0] for log in logs if f"-{arm}-" in log.name)
                for arm in ("candidate", "baseline")}
        assert f"--cpu-affinity {first}" in argv["candidate"] and f"--cpu-affinity {last}" in argv["baseline"], argv
        assert all(w["server_cpus"] == [first] for arms in by_pair.values() for w in arms.values()), by_pair
    assert alive_with(str(tmp_path)) == []
    assert query(tmp_path, "SELECT count(*) AS n FROM processes WHERE ended IS NULL")[0]["n"] == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two cores to mean anything")
def test_a_simultaneous_engine_server_runs_every_thread_on_the_shared_core(tmp_path):
    (tmp_path / "orchestrator.yaml").write_text(STAGED_CONFIG.format(arms="simultaneous"))
    (tmp_path / "plugins").mkdir()
    project = load(tmp_path / "orchestrator.yaml")
    target = project.target
    target.prepare()
    assert target.pairing() == "simultaneous"
    server = target.live_server(beside="simultaneous").start()
    try:
        server.wait_healthy(300)
        tids = os.listdir(f"/proc/{server.pid}/task")
        assert len(tids) > 1  # the engine thread and the HTTP loop at least
        assert {frozenset(os.sched_getaffinity(int(t))) for t in tids} == {frozenset({min(os.sched_getaffinity(0))})}
    finally:
        server.stop()
    plain = target.live_server()
    assert "--cpu-affinity" not in plain.argv


def test_the_pairing_is_simultaneous_on_a_cpu_and_a_gpu_unless_the_config_says_otherwise(tmp_path):
    (tmp_path / "plugins").mkdir()
    cases = [("auto", "cpu", "simultaneous"), ("sequential", "cpu", "sequential"), ("coresident", "cpu", "coresident"),
             ("simultaneous", "cpu", "simultaneous"), ("auto", "cuda", "simultaneous"), ("coresident", "cuda", "coresident"),
             ("simultaneous", "cuda", "simultaneous"), ("sequential", "cuda", "sequential")]
    for arms, device, expected in cases:
        (tmp_path / "orchestrator.yaml").write_text(STAGED_CONFIG.format(arms=arms).replace("device: cpu",
                                                                                            f"device: {device}"))
        assert load(tmp_path / "orchestrator.yaml").target.pairing() == expected, (arms, device)
    # the older spelling still reads
    for old, expected in (("true", "simultaneous"), ("false", "sequential")):
        text = STAGED_CONFIG.format(arms="auto").replace("  arms: auto\n", f"  simultaneous_arms: {old}\n")
        (tmp_path / "orchestrator.yaml").write_text(text)
        assert load(tmp_path / "orchestrator.yaml").target.pairing() == expected
    # beside a co-resident server on a GPU the KV cache is a fixed share; never on a CPU
    gpu = STAGED_CONFIG.format(arms="coresident").replace("device: cpu", "device: cuda")
    (tmp_path / "orchestrator.yaml").write_text(gpu)
    target = load(tmp_path / "orchestrator.yaml").target
    argv = target.live_server(beside="coresident").argv
    assert argv[argv.index("--kv-cache-memory") + 1] == str(16 << 30)
    assert "--kv-cache-memory" not in target.live_server().argv
    assert target.memory_keys() == {"gpu-memory-utilization", "kv-cache-memory"}
    assert target.fills_once()
    # simultaneous on a GPU: the same fixed share, and (given two cores) both servers on the shared one
    (tmp_path / "orchestrator.yaml").write_text(gpu.replace("arms: coresident", "arms: auto"))
    target = load(tmp_path / "orchestrator.yaml").target
    argv = target.live_server(beside="simultaneous").argv
    assert argv[argv.index("--kv-cache-memory") + 1] == str(16 << 30)
    if len(os.sched_getaffinity(0)) > 1:
        assert argv[argv.index("--cpu-affinity") + 1] == str(min(os.sched_getaffinity(0)))
    assert target.fills_once()
    # on a CPU the simultaneous servers fill from idle for every sample unless the config says otherwise
    (tmp_path / "orchestrator.yaml").write_text(STAGED_CONFIG.format(arms="simultaneous"))
    assert not load(tmp_path / "orchestrator.yaml").target.fills_once()


def test_coresident_servers_live_through_the_whole_decision_and_the_kept_one_serves_the_next(tmp_path):
    """As on a GPU, one after the other: the baseline's server is the kept state's and stays up through the
    candidate's decision; the candidate's server, started once, serves its correctness probes and pairs with no
    restart, and once kept serves the final re-validation."""
    run = stage_wider_batch(tmp_path, "coresident")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    steps = {s["plugin"]: s for s in query(tmp_path, "SELECT * FROM steps")}
    assert steps["wider-batch"]["outcome"] == "kept", steps["wider-batch"]
    procs = query(tmp_path, "SELECT p.id, coalesce(s.plugin, 'baseline') AS plugin, p.what, p.started, p.ready, "
                            "p.ended FROM processes p LEFT JOIN steps s ON s.id = p.step_id ORDER BY p.id")
    servers = [p for p in procs if p["what"].startswith("live server")]
    assert [(p["plugin"], p["what"]) for p in servers] == [
        ("baseline", "live server (baseline)"), ("wider-batch", "live server (candidate)"),
        ("(final)", "live server (baseline)")]
    kept, cand, original = servers
    probes = [p for p in procs if p["plugin"] == "wider-batch" and p["what"].startswith("probe serving")]
    assert len(probes) == 4  # two pairs, one after the other
    assert kept["ready"] < cand["started"] < cand["ready"] < min(p["started"] for p in probes)
    assert kept["ended"] >= max(p["ended"] for p in probes)  # the kept state's server lived through the decision
    final = [p for p in procs if p["plugin"] == "(final)" and p["what"].startswith("probe serving")]
    assert cand["ended"] >= max(p["ended"] for p in final) > min(p["started"] for p in final) > original["ready"]
    samples = query(tmp_path, "SELECT coalesce(s.plugin, 'baseline') AS plugin, m.arm, m.server FROM measurements m "
                              "LEFT JOIN steps s ON s.id = m.step_id WHERE m.probe = 'serving' ORDER BY m.id")
    by = lambda plugin, arm: {m["server"] for m in samples if m["plugin"] == plugin and m["arm"] == arm}
    assert by("baseline", "baseline") == by("wider-batch", "baseline") == {kept["id"]}
    assert by("wider-batch", "candidate") == by("(final)", "candidate") == {cand["id"]}
    assert by("(final)", "baseline") == {original["id"]}
    assert alive_with(str(tmp_path)) == []
    assert query(tmp_path, "SELECT count(*) AS n FROM processes WHERE ended IS NULL")[0]["n"] == 0


def test_own_server_cores_give_the_candidate_the_next_core_where_there_are_enough(tmp_path, monkeypatch):
    """`server_cores: own`: measured, the kept state's server on the first core and the candidate's on the second,
    the probes on neither; started aside, the last; with fewer than four cores both share the first, as by
    default. The embedded default takes it from `--server-cores`."""
    import orchestrator.targets.engine as engine_target
    from orchestrator.loading import ConfigError

    (tmp_path / "plugins").mkdir()
    config = STAGED_CONFIG.format(arms="simultaneous")
    for cores, mode, base, cand, probes in [
            (list(range(8)), "own", {0}, {1}, set(range(2, 8))),
            (list(range(8)), "shared", {0}, {0}, set(range(1, 8))),
            ([0, 1, 2], "own", {0}, {0}, {1, 2})]:
        monkeypatch.setattr(engine_target, "cores", lambda cores=cores: cores)
        (tmp_path / "orchestrator.yaml").write_text(config.replace("  arms: simultaneous\n",
                                                                   f"  arms: simultaneous\n  server_cores: {mode}\n"))
        target = load(tmp_path / "orchestrator.yaml").target
        assert target.server_cpus("simultaneous", arm="baseline") == base, (cores, mode)
        assert target.server_cpus("simultaneous", arm="candidate") == cand, (cores, mode)
        assert target.server_cpus("simultaneous", measured=False, arm="candidate") == {cores[-1]}
        assert target.server_cpus("coresident", arm="candidate") is None
        assert target.probe_cpus() == probes, (cores, mode)
        argv = target.live_server(beside="simultaneous", arm="candidate").argv
        assert argv[argv.index("--cpu-affinity") + 1:][:1] == [str(min(cand))]
    monkeypatch.setattr(engine_target, "cores", lambda: list(range(8)))
    embedded = load(None, tmp_path / "plugins", {"device": "cuda", "server_cores": "own"}).target
    assert embedded.server_cpus("simultaneous", arm="candidate") == {1}
    (tmp_path / "orchestrator.yaml").write_text(config.replace("  arms: simultaneous\n",
                                                               "  arms: simultaneous\n  server_cores: mine\n"))
    before = (tmp_path / "orchestrator.yaml").read_bytes()
    with pytest.raises(ConfigError) as bad:
        load(tmp_path / "orchestrator.yaml")
    assert "server_cores" in str(bad.value) and "orchestrator.yaml" in str(bad.value)
    assert (tmp_path / "orchestrator.yaml").read_bytes() == before
