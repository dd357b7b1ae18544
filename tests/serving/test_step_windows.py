"""A window counts whole engine steps over the time they took. A server's counters move once a step, so a window
read between two arbitrary instants misses part of a step at each end: with steps of 300-600 ms (a host-bound
engine on a GPU) that is 3-6% of a 10-s window, noise as large as the effects judged. The engine server publishes
when its last step ended (`engine:last_step_end_time_seconds`); the window opens at the first step end after it
begins and is rated over the span between step ends."""
from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from orchestrator.probes.client import watch_window
from orchestrator.probes.results import window_result, with_score

STEP, TOKENS, PREFILL, BUSY = 0.25, 100, 7, 0.2  # a step every 0.25 s: 100 tokens out, 7 prompt tokens in


class Steps:
    """The counters of an engine that ends a step every STEP seconds from its start, in the engine server's names
    and families."""

    def __init__(self):
        self.born = time.time()

    def collect(self):
        k = int((time.time() - self.born) / STEP)
        for name, value in (("vllm:generation_tokens", TOKENS * k), ("engine:prefill_tokens", PREFILL * k),
                            ("engine:steps", k), ("engine:step_seconds", BUSY * k)):
            family = CounterMetricFamily(name, name)
            family.add_metric([], value)
            yield family
        yield GaugeMetricFamily("engine:last_step_end_time_seconds", "", value=self.born + STEP * k)


@pytest.fixture
def stepping():
    """/metrics served over HTTP by prometheus_client's own server."""
    registry = CollectorRegistry()
    registry.register(Steps())
    httpd, _ = start_http_server(0, "127.0.0.1", registry)
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_windows_at_any_phase_of_a_step_rate_the_same_whole_steps(stepping):
    """Read between two instants, a 1-s window here would count 3, 4 or 5 steps' tokens over 1 s: 300 to 500
    tokens/s for a rate of 400. Between step ends it counts whole steps over the time they took."""
    for phase in (0.0, 0.06, 0.12, 0.19):
        time.sleep(phase)
        start = time.perf_counter()
        watched = asyncio.run(watch_window(stepping, start + 1.0))
        result, cached, _ = window_result([], start, start + 1.0, watched.counters, None)
        result = with_score(result, cached, (1.0, 0.5, 0.0))
        assert result["duration"] == pytest.approx(1.0)
        # opened at a step end, closed at the last one before its close: 3 or 4 steps of 0.25 s, whatever the
        # phase (a closing reading a little late may catch one more; an opening one late by a step, on a loaded
        # machine, one fewer), each rated over exactly the time it took
        steps = result["server_steps"]
        assert 2 <= steps <= 4 and result["rate_seconds"] == pytest.approx(steps * STEP, abs=1e-6), result
        assert result["server_step_busy"] == pytest.approx(BUSY / STEP)
        assert result["output_throughput"] == pytest.approx(TOKENS / STEP, rel=1e-6)
        assert result["input_throughput"] == pytest.approx(PREFILL / STEP, rel=1e-6)
        assert result["score"] == pytest.approx(TOKENS / STEP + 0.5 * PREFILL / STEP, rel=1e-6)


def test_a_server_without_step_ends_is_rated_over_the_window():
    """vLLM publishes no step end: its counters' differences are rated over the window's duration, as before."""
    result, _, _ = window_result([], 0.0, 10.0, {"generation": 1000.0, "prefill": 50.0}, None)
    assert "rate_seconds" not in result and result["output_throughput"] == 100.0
    stale = {"generation": 1000.0, "prefill": 50.0, "steps": 0.0, "step_seconds": 0.0, "step_ended": 0.0}
    result, _, _ = window_result([], 0.0, 10.0, stale, None)  # no step ended inside it: nothing to span
    assert "rate_seconds" not in result and result["output_throughput"] == 100.0


class VllmIterations:
    """vLLM 0.34.0's view of its engine in its own families: an iteration every STEP seconds, each of TOKENS tokens
    with an inter-token latency of ITL seconds per token (histograms, labelled by model, with buckets), a
    preemption every fourth iteration, and no count of prompt tokens computed."""

    def __init__(self):
        self.born = time.time()

    def collect(self):
        k = int((time.time() - self.born) / STEP)
        for name, count, total in (("vllm:inter_token_latency_seconds", TOKENS * k, ITL * TOKENS * k),
                                   ("vllm:iteration_tokens_total", k, TOKENS * k)):
            family = HistogramMetricFamily(name, name, labels=["model_name"])
            family.add_metric(["qwen36"], buckets=[("1.0", count), ("+Inf", count)], sum_value=total)
            yield family
        family = CounterMetricFamily("vllm:num_preemptions", "", labels=["model_name"])
        family.add_metric(["qwen36"], k // 4)
        yield family
        family = CounterMetricFamily("vllm:generation_tokens", "", labels=["model_name"])
        family.add_metric(["qwen36"], TOKENS * k)
        yield family


ITL = 0.031


def test_a_vllm_window_carries_the_servers_own_latency_and_iterations():
    """vLLM has no count of prompt tokens computed, so the client's counts stay the window's; beside them, its own
    inter-token latency (a histogram's sum over its count, not its buckets), its iterations, their mean length and
    tokens, and its preemptions over the window: a window slower than its neighbours is then told as the server's
    or the client's."""
    registry = CollectorRegistry()
    registry.register(VllmIterations())
    httpd, _ = start_http_server(0, "127.0.0.1", registry)
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        start = time.perf_counter()
        watched = asyncio.run(watch_window(url, start + 1.5))
    finally:
        httpd.shutdown()
    result, _, _ = window_result([], start, start + 1.5, watched.counters, None)
    assert result["tokens_source"] == "client"
    assert result["server_itl_ms"] == pytest.approx(1e3 * ITL)
    assert 5 <= result["server_iterations"] <= 7  # 1.5 s of 0.25-s iterations, each end a reading's
    assert result["server_iteration_ms"] == pytest.approx(1.5e3 / result["server_iterations"])
    assert result["server_tokens_per_iteration"] == pytest.approx(TOKENS)
    assert 1 <= result["server_preemptions"] <= 2
    assert "server_queue_ms" not in result  # a family it does not publish stays out
