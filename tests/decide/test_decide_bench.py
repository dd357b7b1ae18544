
import numpy as np

from benchmarks import decisions as bench
from orchestrator.policy import Policy


def cell(effect, cv, drift, trials=400, rule="stat", **policy):
    p = Policy(**policy)
    rng = np.random.default_rng(3)
    if rule == "stat":
        return bench.run_stat(p, effect, cv, drift, trials, rng)
    return bench.run_first(p.repeats, p.min_gain, effect, cv, drift, trials, rng)


def test_targets_at_three_percent_noise_with_drift():
    assert cell(0.10, 0.03, True).keep_rate >= 0.95
    assert cell(0.0, 0.03, True).keep_rate <= 0.05
    assert cell(-0.05, 0.03, True).keep_rate <= 0.01
    big = cell(0.50, 0.03, True)
    assert big.keep_rate == 1.0 and big.mean_samples == Policy().min_pairs


def test_drift_fools_the_first_rule_but_not_the_judge():
    first_null = cell(0.0, 0.01, True, rule="first").keep_rate
    assert first_null > 0.1  # baseline measured first, candidate later: drift looks like a gain
    assert cell(0.0, 0.01, True).keep_rate <= 0.02


def test_drift_is_a_ramp_of_five_percent_up_or_down():
    rng = np.random.default_rng(0)
    series = bench._draw(rng, 2000, 10, 0.0, True)
    assert np.allclose(series[:, 0], 1.0)
    assert set(np.round(series[:, -1], 6)) == {0.95, 1.05}


def test_cli_writes_tables(tmp_path):
    out = tmp_path / "decisions.md"
    bench.main(["--trials", "20", "--out", str(out)])
    text = out.read_text()
    assert text.startswith("Command: `python -m benchmarks.decisions --trials 20 --out")
    assert text.count("\n| ") == 1 + len(bench.EFFECTS) * len(bench.NOISES) * 2


def test_alternating_pair_order_cancels_the_lag_inside_pairs():
    p = Policy()
    lagged = bench.run_stat(p, 0.0, 0.001, True, 200, np.random.default_rng(1), span=6, order="ab")
    alternating = bench.run_stat(p, 0.0, 0.001, True, 200, np.random.default_rng(1), span=6, order="abba")
    assert lagged.verdicts.get("regressed", 0) > 0.3  # a slowing machine makes every candidate look slower
    assert alternating.verdicts.get("regressed", 0) < 0.05
