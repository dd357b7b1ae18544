"""benchmarks/vllm_h200/run.sh's round trip of a run's files: `results` packs them on the GPU machine into the
few files a call brings back, `unpack` lays them out here, and `receive` restores the JIT cache on the next
machine so that its first server start compiles nothing."""
from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "vllm_h200" / "run.sh"


def script(*args: str, tmp: Path, **env: str) -> subprocess.CompletedProcess:
    bin_ = tmp / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 0 MiB, 81559 MiB'\n")
    (bin_ / "nvidia-smi").chmod(0o755)
    full = {**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}", "H200_WORK": str(tmp / "work"),
            "H200_RESULTS": str(tmp / "results"), "H200_JIT": str(tmp / "jit"), "H200_STAGE": str(tmp / "stage"),
            **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, timeout=120)


def a_run(tmp: Path) -> sqlite3.Connection:
    """A machine after a run: its history in WAL mode with rows not yet checkpointed into the file, its log, the
    kept serve config, and the kernels its first server start compiled."""
    work = tmp / "work"
    (work / "state" / "blobs").mkdir(parents=True)
    (work / "serve").mkdir()
    (work / "run.log").write_text("live server: started\n")
    (work / "serve" / "serve.yaml").write_text("max-num-seqs: 256\n")
    (work / "state" / "blobs" / "ab12").write_bytes(b"an image")
    (work / "state" / "server-logs").mkdir()
    (work / "state" / "server-logs" / "run1-baseline.log").write_text(
        "INFO 12-07 03:10:31 [api_server.py:1] vLLM API server version 0.34.0\n"
        + 'INFO:     127.0.0.1:36106 - "POST /v1/completions HTTP/1.1" 200 OK\n' * 5000
        + 'INFO:     127.0.0.1:36106 - "GET /health HTTP/1.1" 200 OK\n'
        + "INFO 12-07 03:13:25 [kernel_warmup.py:294] JIT kernel warmup starting.\n")
    db = sqlite3.connect(work / "state" / "orchestrator.db")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute("CREATE TABLE measurements (id INTEGER PRIMARY KEY, value REAL)")
    db.executemany("INSERT INTO measurements (value) VALUES (?)", [(99191.0,), (148617.0,)])
    db.commit()
    ops = tmp / "home" / ".cache" / "flashinfer" / "0.7.4" / "90a" / "cached_ops" / "norm"
    ops.mkdir(parents=True)
    (ops / "norm.so").write_bytes(os.urandom(4096))
    kernel = tmp / "home" / ".triton" / "cache" / "ABC"
    kernel.mkdir(parents=True)
    (kernel / "fused_moe.cubin").write_bytes(os.urandom(4096))
    (kernel / "fused_moe.ptx").write_text("// PTX\n" * 1000)
    return db  # open: the rows stay in the WAL


def test_results_come_back_in_three_files_and_unpack_here_with_the_history_whole(tmp_path):
    db = a_run(tmp_path)
    out = tmp_path / "out"
    done = script("results", tmp=tmp_path, OUT=str(out), HOME=str(tmp_path / "home"))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["jit-cache.tgz", "results.tgz", "triton-cache.tgz"], done.stdout
    db.close()

    done = script("unpack", "part2", str(out), tmp=tmp_path)
    assert done.returncode == 0, done.stderr
    dest = tmp_path / "results" / "part2"
    rows = sqlite3.connect(dest / "state" / "orchestrator.db").execute("SELECT value FROM measurements").fetchall()
    assert rows == [(99191.0,), (148617.0,)]  # the WAL's rows too, through SQLite's backup
    assert (dest / "run.log").read_text() == "live server: started\n"
    assert (dest / "kept-serve.yaml").read_text() == "max-num-seqs: 256\n"
    assert (dest / "state" / "blobs" / "ab12").read_bytes() == b"an image"
    assert (dest / "server-starts" / "run1-baseline.log").read_text() == (
        "INFO 12-07 03:10:31 [api_server.py:1] vLLM API server version 0.34.0\n"
        "INFO 12-07 03:13:25 [kernel_warmup.py:294] JIT kernel warmup starting.\n")  # no request lines
    for cache in ("jit-cache.tgz", "triton-cache.tgz"):
        assert (tmp_path / "jit" / cache).read_bytes() == (out / cache).read_bytes()
    # a second unpack under the same name changes nothing
    before = {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    again = script("unpack", "part2", str(out), tmp=tmp_path)
    assert again.returncode == 2 and "exists" in again.stderr
    assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before


def test_the_next_machine_gets_the_compiled_kernels_back(tmp_path):
    a_run(tmp_path).close()
    out = tmp_path / "out"
    assert script("results", tmp=tmp_path, OUT=str(out), HOME=str(tmp_path / "home")).returncode == 0
    assert script("unpack", "part2", str(out), tmp=tmp_path).returncode == 0
    payload = tmp_path / "payload"
    (payload / "p0").mkdir(parents=True)
    (payload / "p0" / "part_0").write_bytes(b"the first part")
    fresh = tmp_path / "fresh-home"
    fresh.mkdir()
    done = script("receive", "0", tmp=tmp_path, HOME=str(fresh), H200_PAYLOAD=str(payload))
    assert done.returncode == 0, done.stderr
    so = "0.7.4/90a/cached_ops/norm/norm.so"
    assert (fresh / ".cache" / "flashinfer" / so).read_bytes() == \
        (tmp_path / "home" / ".cache" / "flashinfer" / so).read_bytes()
    cubin = ".triton/cache/ABC/fused_moe.cubin"
    assert (fresh / cubin).read_bytes() == (tmp_path / "home" / cubin).read_bytes()
    assert (fresh / ".triton/cache/ABC/fused_moe.ptx").read_bytes() == b""  # travelled emptied
    assert "JIT cache restored into" in done.stdout and "Triton's cache: 2 files restored" in done.stdout

    # a machine that has compiled kernels of its own keeps them: FlashInfer's whole, Triton's file by file
    (fresh / ".cache" / "flashinfer" / so).write_bytes(b"built here")
    (fresh / cubin).write_bytes(b"compiled here")
    (fresh / ".triton/cache/ABC/fused_moe.ptx").unlink()
    again = script("receive", "0", tmp=tmp_path, HOME=str(fresh), H200_PAYLOAD=str(payload))
    assert again.returncode == 0 and "FlashInfer's" not in again.stdout
    assert "Triton's cache: 1 files restored" in again.stdout
    assert (fresh / ".cache" / "flashinfer" / so).read_bytes() == b"built here"
    assert (fresh / cubin).read_bytes() == b"compiled here"
    assert (fresh / ".triton/cache/ABC/fused_moe.ptx").exists()  # what it lacked, added


def test_the_latest_samples_show_each_fresh_servers_warm_up():
    """`run.sh status` lists the latest serving samples from the history: here part 2's, whose fresh servers'
    first windows (after a fixed warm-up of about 5 s) ran slow."""
    import sys
    sys.path.insert(0, str(SCRIPT.parent))
    from samples import lines

    db = SCRIPT.parent / "results" / "2026-12-06-h100-20-layers-part2" / "state" / "orchestrator.db"
    before = db.read_bytes()
    last = lines(db, 3)
    assert last == [
        "step 5 candidate #1 server 34: score 99,257, 3,243 out tok/s, TPOT 41.5 ms; GPU 460 W 1,980 MHz; warm-up 5.2 s",
        "step 5 baseline #1 server 36: score 120,241, 3,959 out tok/s, TPOT 36.0 ms; GPU 529 W 1,965 MHz; warm-up 5.0 s",
        "step 5 baseline #2 server 36: score 141,251, 4,644 out tok/s, TPOT 27.5 ms; GPU 485 W 1,980 MHz",
    ]
    assert db.read_bytes() == before  # read-only


def test_a_settled_warm_up_shows_its_rates(tmp_path):
    import json
    import sys
    sys.path.insert(0, str(SCRIPT.parent))
    from samples import lines

    db = sqlite3.connect(tmp_path / "h.db")
    db.execute("CREATE TABLE measurements (id INTEGER PRIMARY KEY, step_id INTEGER, arm TEXT, repeat INTEGER, "
               "server INTEGER, value REAL, metrics TEXT, role TEXT, ok INTEGER)")
    metrics = {"output_throughput": 4500.0, "mean_tpot_ms": 27.25, "warmup_seconds": 15.04,
               "warmup_rates": [3100.4, 4200.0, 4480.2, 4470.0], "warmup_settled": True}
    db.execute("INSERT INTO measurements VALUES (1, 3, 'candidate', 0, 7, 140000, ?, 'throughput', 1)",
               (json.dumps(metrics),))
    db.execute("INSERT INTO measurements VALUES (2, 3, 'candidate', 1, 7, 1, '{}', 'correctness', 1)")
    db.commit()
    assert lines(tmp_path / "h.db") == ["step 3 candidate #1 server 7: score 140,000, 4,500 out tok/s, TPOT 27.2 ms; "
                                        "warm-up 15.0 s (rates 3,100 4,200 4,480 4,470), settled"]


def test_a_sample_shows_the_servers_own_latency_and_the_clients_load(tmp_path):
    """Where a window recorded vLLM's own inter-token latency and iterations and the client's share of a core,
    its line shows them: a window slower than its neighbours is the server's or the client's."""
    import json
    import sys
    sys.path.insert(0, str(SCRIPT.parent))
    from samples import lines

    db = sqlite3.connect(tmp_path / "h.db")
    db.execute("CREATE TABLE measurements (id INTEGER PRIMARY KEY, step_id INTEGER, arm TEXT, repeat INTEGER, "
               "server INTEGER, value REAL, metrics TEXT, role TEXT, ok INTEGER)")
    metrics = {"output_throughput": 3406.3, "mean_tpot_ms": 41.0, "server_itl_ms": 40.2, "server_iterations": 331,
               "server_iteration_ms": 30.2, "server_preemptions": 0, "client_busy": 0.552,
               "gpus": [{"power_w": 486.68, "sm_mhz": 1980.0, "temperature_c": 52.0}]}
    db.execute("INSERT INTO measurements VALUES (1, 3, 'baseline', 0, 7, 105635, ?, 'throughput', 1)",
               (json.dumps(metrics),))
    db.commit()
    assert lines(tmp_path / "h.db") == [
        "step 3 baseline #1 server 7: score 105,635, 3,406 out tok/s, TPOT 41.0 ms (server: ITL 40.2 ms, "
        "331 iterations of 30.2 ms, 0 preempted); client 55% of a core; GPU 487 W 1,980 MHz"]


def test_configuration_readings_show_what_differs_from_the_baseline(tmp_path):
    """Each `vllm-config` reading after the baseline's: the baseline's, or its differing keys (old and new value)."""
    import json
    import sys
    sys.path.insert(0, str(SCRIPT.parent))
    from samples import configurations

    db = sqlite3.connect(tmp_path / "h.db")
    db.execute("CREATE TABLE measurements (id INTEGER PRIMARY KEY, step_id INTEGER, arm TEXT, metrics TEXT, "
               "role TEXT, ok INTEGER)")
    base = {"engine": {"scheduler_config.async_scheduling": True, "scheduler_config.max_num_seqs": 256},
            "env": {}, "frontend": {}, "package": "ab12"}
    readings = [(None, "baseline", base),
                (1, "candidate", base),
                (2, "candidate", {**base, "engine": {**base["engine"], "scheduler_config.max_num_seqs": 512},
                                  "package": "cd34"})]
    for i, (step, arm, reading) in enumerate(readings):
        db.execute("INSERT INTO measurements VALUES (?, ?, ?, ?, 'configuration', 1)",
                   (i + 1, step, arm, json.dumps({"configuration": reading})))
    db.execute("INSERT INTO measurements VALUES (9, 3, 'candidate', '{\"error\": \"404\"}', 'configuration', 0)")
    db.commit()
    assert configurations(tmp_path / "h.db") == [
        "configuration step 1 candidate: the baseline's",
        "configuration step 2 candidate: differs in 2: engine.scheduler_config.max_num_seqs 256 -> 512, "
        "package 'ab12' -> 'cd34'",
    ]


def test_a_reading_the_history_cut_is_named_not_a_crash(tmp_path):
    """A history written before configuration readings were stored whole holds some cut to their numbers."""
    import json
    import sys
    sys.path.insert(0, str(SCRIPT.parent))
    from samples import configurations

    db = sqlite3.connect(tmp_path / "h.db")
    db.execute("CREATE TABLE measurements (id INTEGER PRIMARY KEY, step_id INTEGER, arm TEXT, metrics TEXT, "
               "role TEXT, ok INTEGER)")
    cut = json.dumps({"cut": "41234 characters of JSON; only its numbers are kept"})
    db.execute("INSERT INTO measurements VALUES (1, NULL, 'baseline', ?, 'configuration', 1)", (cut,))
    db.execute("INSERT INTO measurements VALUES (2, 1, 'candidate', ?, 'configuration', 1)", (cut,))
    db.commit()
    assert configurations(tmp_path / "h.db") == ["configuration baseline baseline: no reading (cut)"]
    db.execute("INSERT INTO measurements VALUES (3, NULL, 'baseline', ?, 'configuration', 1)",
               (json.dumps({"configuration": {"engine": {"a": 1}}}),))
    db.commit()
    assert configurations(tmp_path / "h.db") == ["configuration step 1 candidate: no reading (cut)"]


def test_a_poll_mid_run_names_the_serve_config_as_it_is_not_as_kept(tmp_path):
    """While a run is going the serve config may hold the change of the step being measured: a poll brings it back
    as serve-now.yaml, and kept-serve.yaml only once no run is going (a cut part once passed a candidate's
    config as the kept stack to `cotenant`)."""
    db = a_run(tmp_path)
    (tmp_path / "work" / "serve" / "serve.yaml").write_text("max-num-seqs: 256\nkernel-config: {moe_backend: x}\n")
    # the serve environment beside it comes back under the same name (FROM= restores the one beside the file given)
    (tmp_path / "work" / "serve" / "serve-env.yaml").write_text("VLLM_USE_BREAKABLE_CUDAGRAPH: '0'\n")
    run = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "work" / "run.pid").write_text(f"{run.pid}\n")
        out = tmp_path / "out"
        done = script("status", tmp=tmp_path, OUT=str(out), HOME=str(tmp_path / "home"))
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"running (pid {run.pid})")
    finally:
        run.kill()
        run.wait()
    db.close()
    assert script("unpack", "cut", str(out), tmp=tmp_path).returncode == 0
    dest = tmp_path / "results" / "cut"
    assert (dest / "serve-now.yaml").read_text() == "max-num-seqs: 256\nkernel-config: {moe_backend: x}\n"
    assert (dest / "serve-now-env.yaml").read_text() == "VLLM_USE_BREAKABLE_CUDAGRAPH: '0'\n"
    assert not (dest / "kept-serve.yaml").exists() and not (dest / "kept-serve-env.yaml").exists()
    # the run gone, the same poll names it kept
    again = tmp_path / "out2"
    assert script("status", tmp=tmp_path, OUT=str(again), HOME=str(tmp_path / "home")).returncode == 0
    assert script("unpack", "done", str(again), tmp=tmp_path).returncode == 0
    assert (tmp_path / "results" / "done" / "kept-serve.yaml").is_file()
    assert (tmp_path / "results" / "done" / "kept-serve-env.yaml").is_file()
    assert not (tmp_path / "results" / "done" / "serve-now.yaml").exists()


def test_every_poll_brings_the_history_back(tmp_path):
    """`OUT=… run.sh status` packs results.tgz as `results` does (no report), and the JIT cache: a machine taken
    back mid-run leaves here what it had decided."""
    db = a_run(tmp_path)
    first, second = tmp_path / "out1", tmp_path / "out2"
    done = script("status", tmp=tmp_path, OUT=str(first), HOME=str(tmp_path / "home"))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in first.iterdir()) == ["jit-cache.tgz", "results.tgz", "triton-cache.tgz"], done.stdout
    db.execute("INSERT INTO measurements (value) VALUES (150000.0)")
    db.commit()
    done = script("status", tmp=tmp_path, OUT=str(second), HOME=str(tmp_path / "home"))
    assert sorted(p.name for p in second.iterdir()) == ["jit-cache.tgz", "results.tgz", "triton-cache.tgz"], done.stdout
    db.close()
    assert script("unpack", "cut", str(second), tmp=tmp_path).returncode == 0
    dest = tmp_path / "results" / "cut"
    rows = sqlite3.connect(dest / "state" / "orchestrator.db").execute("SELECT value FROM measurements").fetchall()
    assert rows == [(99191.0,), (148617.0,), (150000.0,)]
    assert (dest / "kept-serve.yaml").read_text() == "max-num-seqs: 256\n"
    # without OUT, a poll writes nothing
    assert script("status", tmp=tmp_path, HOME=str(tmp_path / "home")).returncode == 0
    assert not (tmp_path / "work" / "results").exists()
