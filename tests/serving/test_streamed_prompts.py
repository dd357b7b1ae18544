"""probes/results.py: a steady-state window's prompts counted over their streamed tokens (`score_streamed`) have
the mean of counting each whole at its first token, without its steps of a whole prompt."""
from __future__ import annotations

import random
import statistics

import pytest

from orchestrator.probes.client import Outcome
from orchestrator.probes.results import DEFAULT_WEIGHTS, streamed_prompts, summarize_window, with_score


def request(first: float, tokens: int, step: float, prompt: int = 1000, done: bool = True, cached: int = 0) -> Outcome:
    times = [first + i * step for i in range(tokens)]
    return Outcome(success=done, prompt_len=prompt, max_tokens=200 if not done else tokens,
                   output_tokens=tokens if done else 0, cached_tokens=cached if done else None,
                   first_at=times[0], token_times=times, ttft=0.1, latency=times[-1] - first + 0.1)


def test_each_request_counts_the_share_of_its_output_the_window_streamed():
    inside = lambda t: 10.0 <= t < 20.0  # noqa: E731
    whole = request(11.0, 100, 0.05)                         # all 100 tokens inside: its whole prompt
    tail = request(5.0, 200, 0.05, cached=400)               # tokens at 5.0 .. 14.95: the last 100 of 200
    streaming = request(19.0, 20, 0.05, done=False)          # 20 of the 200 it asked for, 19.0 .. 19.95
    before = request(1.0, 50, 0.05)                          # none inside
    assert streamed_prompts([whole, tail, streaming, before], inside) == pytest.approx(
        (1000 + 500 + 100, 200))


def test_a_window_adds_the_streamed_score_beside_the_score():
    outcomes = [request(10.0 + i, 50, 0.1) for i in range(5)]
    result, cached, _ = summarize_window(outcomes, 10.0, 20.0)
    scored = with_score(result, cached, DEFAULT_WEIGHTS)
    w_out, w_in, _ = DEFAULT_WEIGHTS
    assert scored["streamed_input_throughput"] == pytest.approx(result["streamed_input_tokens"] / 10.0)
    assert scored["score_streamed"] == pytest.approx(w_out * scored["output_throughput"]
                                                     + w_in * scored["streamed_input_throughput"])


def test_in_a_closed_loop_both_counts_have_one_mean_and_the_streamed_one_spreads_less():
    """128 request loops of 1,000 in / 200 out, the decode step jittering, measured over 10-s windows: counting
    prompts at their first token moves by whole prompts from one window to the next; counted as they stream, not."""
    rng = random.Random(3)
    outcomes: list[Outcome] = []
    for slot in range(128):
        t = rng.uniform(0, 6.0)  # the loops' phases spread, as the fill leaves them
        while t < 400.0:
            step = 0.028 * rng.uniform(0.9, 1.1)
            outcomes.append(request(t + 0.3, 200, step))
            t += 0.3 + 200 * step
    first_token, streamed = [], []
    for start in range(20, 380, 12):
        inside = lambda x, a=float(start): a <= x < a + 10.0  # noqa: E731
        first_token.append(sum(o.prompt_len for o in outcomes if inside(o.first_at)) / 10.0)
        streamed.append(streamed_prompts(outcomes, inside)[0] / 10.0)
    assert statistics.mean(streamed) == pytest.approx(statistics.mean(first_token), rel=0.01)
    assert statistics.stdev(streamed) < 0.5 * statistics.stdev(first_token)
