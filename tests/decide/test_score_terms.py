"""noise.score_terms: which weighted term of the serving score its spread within a server comes from."""
from __future__ import annotations

import math

import pytest

from orchestrator.noise import score_terms
from orchestrator.status import terms_line

WEIGHTS = {"output": 16.796, "input": 2.799, "cached": 0.56}


def sample(out: float, inp: float, weights=WEIGHTS) -> dict:
    return {"output_throughput": out, "input_throughput": inp, "cached_throughput": 0.0, "score_weights": weights,
            "score": weights["output"] * out + weights["input"] * inp}


def test_a_window_that_counts_prompts_whole_shows_in_the_input_term_alone():
    # two servers of one state: the decode rate steady, the prompts the window counted moving by whole prompts
    samples = [("a", sample(4640, 23000)), ("a", sample(4640, 24000)), ("a", sample(4640, 22000)),
               ("b", sample(4600, 23200)), ("b", sample(4600, 22200))]
    terms = score_terms(samples)
    mean = sum(s["score"] for _, s in samples) / len(samples)
    # within a: inputs 23000, 24000, 22000 (squares 2e6); within b: 23200, 22200 (5e5); 3 degrees of freedom
    expected_input = WEIGHTS["input"] * math.sqrt(2.5e6 / 3) / mean
    assert terms["input"] == pytest.approx(expected_input, rel=1e-12)
    assert terms["output"] == 0.0 and terms["cached"] == 0.0
    assert terms["score"] == pytest.approx(terms["input"], rel=1e-12)  # the server level (4640 vs 4600) is not in it


def test_the_streamed_score_is_set_beside_where_every_sample_has_it():
    samples = [("a", {**sample(4640, 23000), "score_streamed": 100.0}),
               ("a", {**sample(4640, 24000), "score_streamed": 102.0})]
    terms = score_terms(samples)
    mean = (samples[0][1]["score"] + samples[1][1]["score"]) / 2
    assert terms["streamed"] == pytest.approx(math.sqrt(2.0) / mean)  # sd of 100, 102 over the score's mean
    assert terms_line(terms).endswith(f"counting each prompt over its streamed tokens instead (score_streamed), "
                                      f"{terms['streamed']:.2%}")
    assert "streamed" not in score_terms([samples[0], ("a", sample(4640, 24000))])  # one lacks it: not said


def test_the_score_spreads_no_more_than_its_terms_together():
    samples = [(s, sample(4640 + 40 * ((i * 7) % 5 - 2), 23000 + 500 * ((i * 3) % 4 - 1.5)))
               for s in ("a", "b", "c") for i in range(4)]
    terms = score_terms(samples)
    assert 0 < terms["score"] <= terms["output"] + terms["input"] + terms["cached"] + 1e-12
    line = terms_line(terms)
    assert line.startswith(f"within a server the score spreads by {terms['score']:.2%} of its mean: its output term ")
    assert "its cached term" not in line  # a term that never moved is not named


def test_nothing_to_say_without_weights_or_without_two_samples_of_a_server():
    assert score_terms([("a", {"score": 1.0}), ("a", {"score": 2.0})]) is None  # an objective that is no score
    assert score_terms([("a", sample(1, 2)), ("b", sample(1, 3))]) is None  # one sample a server
    assert score_terms([]) is None and terms_line(None) is None
    # a failed sample's metrics (no score) are left out, not counted as zero
    terms = score_terms([("a", sample(10, 20)), ("a", {"score_weights": WEIGHTS}), ("a", sample(10, 20))])
    assert terms["score"] == 0.0 and terms_line(terms) is None
