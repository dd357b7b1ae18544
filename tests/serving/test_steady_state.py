"""Steady-state samples: a window of fixed length at full concurrency, counted by the server's own token
counters where it has them; the workload type the targets and the probe share; the live server's report of what
it runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from orchestrator.probes.workload import Workload
from serving_support import run_probe, start_server, write_config

STEADY = ["--duration", "2", "--ramp", "0.5", "--max-concurrency", "4", "--input-len", "24", "--output-len", "8",
          "--shared-prefix-fraction", "0"]


def test_a_steady_window_lasts_its_duration_and_counts_what_the_server_computed(server, tmp_path):
    smi = tmp_path / "nvidia-smi"  # the machine's GPU as nvidia-smi reports it, read at the window's end
    smi.write_text('#!/bin/sh\necho "1980, 3201, 61, 512.34, 0x0000000000000000"\n')
    smi.chmod(0o755)
    rc, out, err = run_probe("--base-url", server, *STEADY, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert rc == 0, err
    assert out["gpus"] == [{"sm_mhz": 1980.0, "memory_mhz": 3201.0, "temperature_c": 61.0, "power_w": 512.34,
                            "clock_events": "0x0000000000000000"}]
    assert out["fill_ended"] == "prefilled" and out["fill_prefilled"] == 4
    assert out["steady_state"] is True and out["duration"] == pytest.approx(2.0, abs=0.05)
    assert out["tokens_source"] == "server"
    # the server counts prompt tokens chunk by chunk, the client at each request's first token: close, not equal
    assert out["total_output_tokens"] > 0 and out["total_input_tokens"] > 0
    assert abs(out["total_output_tokens"] - out["client_output_tokens"]) <= 0.25 * out["client_output_tokens"] + 8
    assert out["score"] == pytest.approx(16.796 * out["output_throughput"] + 2.799 * out["input_throughput"]
                                         + 0.56 * out["cached_throughput"])
    assert out["requests_sent"] >= 4 and out["client_cpu_seconds"] > 0
    # the window's requests still running were cancelled: the server is idle again
    metrics = httpx.get(f"{server}/metrics", timeout=10).text
    running = [ln for ln in metrics.splitlines() if ln.startswith("vllm:num_requests_running")]
    assert running and float(running[0].split()[-1]) <= 4


def test_the_server_says_what_it_runs_and_a_kv_budget_given_on_its_command_line_wins(tmp_path):
    config = write_config(tmp_path)
    proc, url = start_server(config, "--kv-cache-memory", str(1 << 22))
    try:
        info = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["engine"]
        log = proc.tail()
    finally:
        proc.stop()
    assert info["device"] == "cpu" and info["dtype"] == "float32" and info["kernels"]["moe-dispatch"]
    assert "(0.00 GiB)" in log  # sized at 4 MiB, not the config's 16 MiB (0.02 GiB)


@pytest.mark.parametrize("args, says", [(["--duration", "0"], "--duration"), (["--ramp", "-1", "--duration", "1"], "--ramp"),
                                        (["--token-id-range", "5", "5"], "token_low")])
def test_a_bad_workload_is_refused_naming_the_option(args, says):
    proc = subprocess.run([sys.executable, "-m", "orchestrator.probes.serving", "--base-url", "http://127.0.0.1:9",
                           *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr


def test_one_workload_type_round_trips_through_the_probes_arguments():
    from orchestrator.probes.serving import parse_args
    w = Workload(num_prompts=7, input_len=33, output_len=5, range_ratio=0.1, shared_prefix_fraction=0.25,
                 token_low=3, token_high=99, request_rate=2.5, max_concurrency=6, seed=4, windows=2, duration=4.0,
                 ramp=1.5, warmup=True)
    assert parse_args(w.argv()).workload == w
    # the stream is seeded: the same requests on every server, none equal to the batch's
    a, b = Workload(duration=1).stream(), Workload(duration=1).stream()
    assert [next(a) for _ in range(5)] == [next(b) for _ in range(5)]


def measure_stand_in(costs, *extra: str) -> dict:
    """One steady-state sample (16 in flight, 500 in / 200 out, a 2 s window) of a fresh batch stand-in whose step
    costs are ``costs``; the probe must succeed."""
    from orchestrator.probes.live_server import LiveServer

    options = [arg for name, value in vars(costs).items() for arg in (f"--{name.replace('_', '-')}", str(value))]
    server = LiveServer([sys.executable, str(Path(__file__).with_name("batch_model.py")), "--port", "{port}", *options])
    try:
        server.start().wait_healthy(60)
        rc, out, err = run_probe("--base-url", server.url, "--duration", "2", "--ramp", "0.3", "--max-concurrency",
                                 "16", "--input-len", "500", "--output-len", "200", "--shared-prefix-fraction", "0",
                                 "--request-timeout", "60", *extra, timeout=180)
    finally:
        server.stop()
    assert rc == 0, err
    return out


def test_a_window_from_an_idle_server_measures_the_steady_state_of_a_server_whose_requests_outlive_it(tmp_path):
    """A request lives about 11 s here, five windows long: started all at once, the first wave would prefill
    together and then only decode, and a window would see one phase of that wave, not the mix a steady state
    has (a quarter below it with these costs; two and a half times above it with an H200's). The fill spreads
    the first wave's lengths, so the window finds the steady state's rates."""
    from batch_model import Costs, steady_rates

    costs = Costs(base=0.03, per_decode=0.0015, per_prefill=0.00006, budget=2048)
    out = measure_stand_in(costs)
    prompt_rate, generated_rate = steady_rates(costs, 16, 500, 200)
    truth = 16.796 * generated_rate + 2.799 * prompt_rate
    assert out["tokens_source"] == "server" and out["fill_seconds"] > 0.3  # 8,000 prompt tokens came first
    assert out["score"] == pytest.approx(truth, rel=0.12), (out["score"], truth)
    assert out["output_throughput"] == pytest.approx(generated_rate, rel=0.12)
    # the server's own steps: busy all the window, each of 16 decoding sequences (and a prompt's chunks)
    assert out["server_step_busy"] == pytest.approx(1.0, abs=0.1), out
    assert out["server_step_ms"] == pytest.approx(1e3 * 16 / generated_rate, rel=0.12), out
    assert out["server_steps"] * out["server_step_ms"] == pytest.approx(1e3 * out["server_step_busy"] * 2, rel=0.01)


def test_a_window_waits_for_a_first_wave_that_takes_longer_than_half_a_window_to_prefill(tmp_path):
    """Found on an H200: the engine's first wave of 128 prompts took 10-20 s to prefill, and a fill cut at half
    a 10 s window left 30-80 of them for the window, whose score then rose with the backlog it found (prompt tokens
    are cheaper than generated ones) and fell with the decoding it lacked. Here the wave needs about 2 s of
    prefill-bound steps, twice the fill a half window allowed: the window begins when the wave is prefilled, and
    finds the steady state's rates."""
    from batch_model import Costs, steady_rates

    costs = Costs(base=0.03, per_decode=0.0015, per_prefill=0.0002, budget=600)
    out = measure_stand_in(costs)
    prompt_rate, generated_rate = steady_rates(costs, 16, 500, 200)
    assert out["fill_prefilled"] == 16 and out["fill_ended"] == "prefilled" and out["fill_seconds"] > 1.5, out
    assert out["output_throughput"] == pytest.approx(generated_rate, rel=0.12), (out["output_throughput"], generated_rate)
    assert out["input_throughput"] == pytest.approx(prompt_rate, rel=0.3), (out["input_throughput"], prompt_rate)
    truth = 16.796 * generated_rate + 2.799 * prompt_rate
    assert out["score"] == pytest.approx(truth, rel=0.12), (out["score"], truth)


def test_a_server_that_runs_fewer_sequences_than_the_wave_is_measured_once_its_queue_stops_draining(tmp_path):
    """Two slots and a wave of 16: the server would prefill the last of the wave only after seven request
    lives, about 20 s, and one that runs one sequence (the seed's baseline) after minutes. It admits a prompt only
    as a request ends, so the prompts waiting for their first token stop draining, and the fill ends a second
    later; the interleaved lengths make the two it runs first a short and a long one: the window still finds the
    steady state of two slots."""
    from batch_model import Costs, steady_rates

    costs = Costs(base=0.03, per_decode=0.0015, per_prefill=0.00006, budget=2048, max_seqs=2)
    out = measure_stand_in(costs)
    assert 2 <= out["fill_prefilled"] < 16 and out["fill_ended"] == "saturated", out
    assert out["fill_seconds"] == pytest.approx(1.0, abs=0.3)
    prompt_rate, generated_rate = steady_rates(costs, 2, 500, 200)
    assert out["output_throughput"] == pytest.approx(generated_rate, rel=0.12), (out["output_throughput"], generated_rate)


def test_the_fill_spreads_any_first_few_of_the_wave():
    lengths = Workload(max_concurrency=16, output_len=200, duration=1).fill()
    assert sorted(lengths) == [max(1, -(-(i + 1) * 200 // 16)) for i in range(16)]
    for k in (2, 4, 8):  # the first k span most of 1..200, whichever k slots a server has
        assert max(lengths[:k]) - min(lengths[:k]) >= 200 * (1 - 2 / k) - 13


def test_a_fresh_server_that_warms_under_load_is_measured_once_its_rate_stops_rising():
    """Found on one H100: after a fixed 3-s warm-up, the first 10-s window on each fresh vLLM server measured 18.5%
    below the later windows (9 servers): the server was still getting faster. Here the stand-in's steps take up to
    three times as long until it has been busy 12 s. The warm-up reads the stream's rate every few seconds and
    goes on while it rises; the window after it finds the warm steady state, and the same window on a fresh
    server without a warm-up the cold one."""
    from batch_model import Costs, steady_rates

    costs = Costs(base=0.03, per_decode=0.0015, per_prefill=0.00006, budget=2048, cold_seconds=12, cold_factor=3)
    _, generated_rate = steady_rates(costs, 16, 500, 200)
    warmed = measure_stand_in(costs, "--warmup")
    rates = warmed["warmup_rates"]
    assert warmed["warmup_settled"] is True and warmed["warmup_seconds"] >= 9, warmed
    assert rates[-2] > 1.5 * rates[0] and rates[-1] <= 1.05 * rates[-2], rates  # rose, then held
    assert warmed["output_throughput"] == pytest.approx(generated_rate, rel=0.12), (warmed, generated_rate)
    cold = measure_stand_in(costs)
    assert "warmup_seconds" not in cold and cold["output_throughput"] < 0.75 * generated_rate, (cold, generated_rate)


def test_a_warm_server_is_warmed_for_a_window_and_two_steps_of_the_same_rate():
    """A server already warm holds its rate from the first step: the warm-up ends once it has run a window's length
    (here shorter than its two steps), not at its limit."""
    from batch_model import Costs
    from orchestrator.probes.serving import WARM_SECONDS

    out = measure_stand_in(Costs(base=0.03, per_decode=0.0015, per_prefill=0.00006, budget=2048), "--warmup")
    assert out["warmup_settled"] is True and len(out["warmup_rates"]) <= 3, out
    assert 2 * WARM_SECONDS <= out["warmup_seconds"] < 3 * WARM_SECONDS + 1, out
