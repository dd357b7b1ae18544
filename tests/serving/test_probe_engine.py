"""The serving probe end to end against the engine server, and its scoring of imported results."""
from __future__ import annotations

import asyncio
import json
import math
import subprocess

import httpx
import pytest

from serving_support import PY, REPO, alive_with, env, run_probe, write_config
from orchestrator.probes.client import prefix_cache_hits
from orchestrator.probes.results import with_score
from orchestrator.probes.serving import PAIR_STRIDE, failure
from orchestrator.probes.workload import Workload

WORKLOAD = ["--num-prompts", "8", "--input-len", "40", "--output-len", "6",
            "--shared-prefix-fraction", "0.5", "--max-concurrency", "4", "--seed", "3"]
VLLM_FIELDS = ["duration", "completed", "total_input_tokens", "total_output_tokens",
               "request_throughput", "output_throughput", "total_token_throughput",
               *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl") for stat in ("mean", "median", "p99"))]


def test_probe_serves_the_target_config_and_scores_it(tmp_path):
    root = tmp_path / "workspace"
    write_config(root)
    rc, out, err = run_probe(*WORKLOAD, ORCHESTRATOR_TARGET_ROOT=str(root))
    assert rc == 0, (out, err)
    for key in VLLM_FIELDS:
        assert isinstance(out[key], (int, float)), key
    assert out["completed"] == 8 and out["failed"] == 0 and out["errors"] == []
    assert out["total_output_tokens"] == 8 * 6
    assert out["total_input_tokens"] == 8 * 40
    # 20 shared tokens: one full 16-token block per prompt comes from the cache, which the test
    # request before the timed run fills; that request is the first prompt, whose two full
    # blocks are then both cached (as `vllm bench serve` does, the first prompt is the test)
    assert out["cached_tokens_source"] == "usage"
    assert out["total_cached_tokens"] == 7 * 16 + 32
    d = out["duration"]
    assert out["input_throughput"] == pytest.approx((320 - 144) / d)
    assert out["cached_throughput"] == pytest.approx(144 / d)
    assert out["score"] == pytest.approx(16.796 * out["output_throughput"] + 2.799 * out["input_throughput"]
                                         + 0.56 * out["cached_throughput"])
    assert out["mean_ttft_ms"] > 0 and out["mean_itl_ms"] > 0
    # the server's own CPU time over the same window: the CPU objective divides the same weighted
    # tokens by it instead of by wall time
    assert 0 < out["server_cpu_seconds"] and out["cpu_utilization"] == pytest.approx(out["server_cpu_seconds"] / d)
    assert out["cpu_score"] == pytest.approx(out["score"] * d / out["server_cpu_seconds"])
    assert out["output_tokens_per_cpu_second"] == pytest.approx(48 / out["server_cpu_seconds"])
    assert out["server_ready_seconds"] > 0 and "warmup_seconds" not in out
    assert alive_with(str(root)) == []


def test_probe_against_a_running_server_leaves_it_running(server):
    rc, out, err = run_probe("--base-url", server, "--num-prompts", "4", "--input-len", "20",
                             "--output-len", "3", "--seed", "8")
    assert rc == 0, (out, err)
    assert out["base_url"] == server and out["completed"] == 4 and out["model_id"] == "tiny"
    assert httpx.get(f"{server}/health").status_code == 200


def test_cached_tokens_can_come_from_the_metrics(server):
    """`vllm serve` reports cached tokens in usage only on request; the probe then reads
    vllm:prefix_cache_hits_total before and after the run."""
    before = asyncio.run(prefix_cache_hits(server))
    prompt = list(range(100, 140))
    for _ in range(2):
        httpx.post(f"{server}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert asyncio.run(prefix_cache_hits(server)) - before == 32
    assert asyncio.run(prefix_cache_hits("http://127.0.0.1:9")) is None  # nothing listens there


def test_server_dying_mid_run_fails_the_probe_and_leaves_nothing(tmp_path):
    config = write_config(tmp_path / "dying")
    cmd = f"{PY} {REPO}/tests/serving/dying_server.py 4 --config {config} --port {{port}}"
    rc, out, _ = run_probe("--server-cmd", cmd, "--num-prompts", "12", "--max-concurrency", "2",
                           "--input-len", "8", "--output-len", "20")
    assert rc == 1
    assert out["server_exit_code"] == 7
    assert 0 < out["completed"] < 12 and out["failed"] == 12 - out["completed"]
    assert f"{out['failed']} of 12 requests failed" in out["error"]
    assert out["errors"], "the failed requests' errors are reported"
    assert alive_with(str(config)) == []


def test_workload_is_seeded_and_shares_the_prefix():
    a = Workload(num_prompts=5, input_len=30, output_len=4, range_ratio=0.5,
                 shared_prefix_fraction=0.4, seed=9)
    assert a.requests() == Workload(**{**a.__dict__}).requests()
    assert a.requests() != Workload(**{**a.__dict__, "seed": 10}).requests()
    prompts = [p for p, _ in a.requests()]
    assert all(p[:12] == prompts[0][:12] for p in prompts)
    assert all(15 <= len(p) <= 45 and 2 <= n <= 6 for p, n in a.requests())
    assert Workload(num_prompts=3).delays() == [0.0, 0.0, 0.0]
    paced = Workload(num_prompts=200, request_rate=50.0).delays()
    assert paced == sorted(paced) and 2.0 < paced[-1] < 6.0  # ~199 gaps of 1/50 s


def test_failed_fraction_threshold():
    assert failure({"completed": 9, "failed": 1}, 0.1) is None
    assert "2 of 10 requests failed" in failure({"completed": 8, "failed": 2}, 0.1)
    assert failure({"completed": 10, "failed": 0}, 0.0) is None
    assert failure({"completed": 0, "failed": 0}, 1.0) == "no request completed"


def test_score_weights_are_configurable():
    base = {"duration": 2.0, "total_input_tokens": 100, "output_throughput": 10.0}
    out = with_score(dict(base), 40, (1.0, 0.0, 0.0))
    assert out["score"] == 10.0
    out = with_score(dict(base), 40, (0.0, 1.0, 1.0))
    assert out["input_throughput"] == 30.0 and out["cached_throughput"] == 20.0 and out["score"] == 50.0


def vllm_result() -> dict:
    return {"date": "20250101-000000", "backend": "vllm", "model_id": "Qwen/Qwen3.6-35B-A3B",
            "num_prompts": 128, "request_rate": "inf", "max_concurrency": 128, "duration": 64.0,
            "completed": 128, "failed": 0, "total_input_tokens": 128_000, "total_output_tokens": 32_000,
            "request_throughput": 2.0, "output_throughput": 500.0, "total_token_throughput": 2500.0,
            "mean_ttft_ms": 900.0, "input_lens": [1000] * 128, "ttfts": [0.9] * 128}


def test_import_result_scores_a_vllm_bench_serve_file(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps(vllm_result()))
    rc, out, _ = run_probe("--import-result", str(path))
    assert rc == 0
    assert out["input_throughput"] == 2000.0 and out["cached_throughput"] == 0.0
    assert out["score"] == pytest.approx(16.796 * 500 + 2.799 * 2000)
    assert out["model_id"] == "Qwen/Qwen3.6-35B-A3B"
    assert "ttfts" not in out  # per-request lists stay in the file


@pytest.mark.parametrize("change, message", [
    ({"output_throughput": None}, "field 'output_throughput' is missing or not a number"),
    ({"duration": 0}, "field 'duration' must be positive"),
    ({"completed": "128"}, "field 'completed' is missing or not a number"),
])
def test_import_result_names_the_bad_field_and_changes_nothing(tmp_path, change, message):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({**vllm_result(), **change}))
    before = path.read_bytes()
    rc, out, _ = run_probe("--import-result", str(path))
    assert rc == 1
    assert out["error"] == f"{path}: {message}" or out["error"].startswith(f"{path}: {message}")
    assert path.read_bytes() == before


def test_import_result_that_is_not_json(tmp_path):
    path = tmp_path / "result.json"
    path.write_text("duration: 3")
    rc, out, _ = run_probe("--import-result", str(path))
    assert rc == 1 and out["error"].startswith(f"{path}: cannot read a JSON result")


def test_import_result_with_failures_past_the_threshold(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({**vllm_result(), "completed": 100, "failed": 28}))
    rc, out, _ = run_probe("--import-result", str(path), "--max-failed-fraction", "0.1")
    assert rc == 1 and "28 of 128 requests failed" in out["error"]
    assert math.isfinite(out["score"])


def test_warm_up_runs_other_prompts_before_the_window(tmp_path):
    """The warm-up batch must not prime the measured prompts' prefix cache: the cached tokens are
    those of a run without it."""
    root = tmp_path / "workspace"
    write_config(root)
    rc, out, err = run_probe(*WORKLOAD, "--warmup", ORCHESTRATOR_TARGET_ROOT=str(root))
    assert rc == 0, (out, err)
    assert out["warmup_seconds"] > 0 and out["completed"] == 8
    assert out["total_cached_tokens"] == 7 * 16 + 32


def test_several_windows_report_the_best_and_each_one(tmp_path):
    root = tmp_path / "workspace"
    write_config(root)
    rc, out, err = run_probe(*WORKLOAD, "--windows", "3", "--best-of", "cpu_score",
                             ORCHESTRATOR_TARGET_ROOT=str(root))
    assert rc == 0, (out, err)
    assert out["best_of"] == "cpu_score" and len(out["windows"]) == 3
    seeds = [w["seed"] for w in out["windows"]]
    assert len(set(seeds)) == 3 and seeds[0] == 3  # each pass its own prompts
    assert out["cpu_score"] == max(w["cpu_score"] for w in out["windows"])
    assert out["seed"] in seeds and all(w["completed"] == 8 for w in out["windows"])
    # each pass starts cold for its own prompts: the cache holds only what that pass shares
    assert out["total_cached_tokens"] == 7 * 16 + 32


def test_the_pair_index_offsets_the_seed_and_comes_from_the_environment(server):
    """Both samples of a pair send the same prompts, other pairs other ones (docs/orchestrator.md 1.5)."""
    args = ["--base-url", server, "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--seed", "5"]
    rc, first, _ = run_probe(*args)
    assert rc == 0 and (first["pair"], first["seed"]) == (0, 5)
    rc, by_env, _ = run_probe(*args, ORCHESTRATOR_PAIR="2")
    rc2, by_flag, _ = run_probe(*args, "--pair", "2", ORCHESTRATOR_PAIR="7")
    assert rc == rc2 == 0 and by_env["seed"] == by_flag["seed"] == 5 + 2 * PAIR_STRIDE and by_flag["pair"] == 2
    bad = subprocess.run([PY, "-m", "orchestrator.probes.serving", *args], capture_output=True, text=True,
                         timeout=60, env=env(ORCHESTRATOR_PAIR="two"))
    assert bad.returncode == 2 and "$ORCHESTRATOR_PAIR must be a whole number, got 'two'" in bad.stderr
