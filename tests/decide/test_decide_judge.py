import math

import numpy as np
import pytest
from scipy import stats

from orchestrator.policy import Policy
from orchestrator.decide import (Decision, Judge, first_rule, implausible_veto, outcome, paired_interval,
                                 verdict_for, welch_interval)


def policy(**kw):
    return Policy(**kw)


def judge_sequence(judge, baseline, candidate):
    """Feed pairs one at a time, as the staging loop does; return the decision and the pairs it took."""
    n_max = min(len(baseline), judge.max_pairs)
    for n in range(1, n_max + 1):
        decision = judge.decide(baseline[:n], candidate[:n], final=n == n_max)
        if decision is not None:
            return decision, n
    raise AssertionError("the final call must decide")


# first rule -----------------------------------------------------------------------------------

def test_first_rule_keeps_a_clear_gain():
    d = first_rule([100, 101, 99], [110, 111, 109], 0.02)
    assert d.verdict == "keep" and d.gain == pytest.approx(0.10)
    assert (d.n_baseline, d.n_candidate, d.baseline_median, d.candidate_median) == (3, 3, 100, 110)


def test_first_rule_needs_separated_samples():
    assert first_rule([100, 120, 99], [110, 111, 109], 0.02).verdict == "no_gain"


def test_first_rule_regressed_when_worse_by_min_gain():
    assert first_rule([100, 100, 100], [97, 97, 98], 0.02).verdict == "regressed"
    assert first_rule([100, 100, 100], [99, 99, 99], 0.02).verdict == "no_gain"


def test_judge_with_first_rule_waits_for_repeats_then_matches_first_rule():
    judge = Judge(policy(rule="first", repeats=3))
    assert judge.decide([100, 101], [110, 111], final=False) is None
    d = judge.decide([100, 101, 99], [110, 111, 109], final=False)
    assert d.to_dict() == first_rule([100, 101, 99], [110, 111, 109], 0.02).to_dict()
    assert judge.decide([100], [90], final=True).verdict == "regressed"


# intervals --------------------------------------------------------------------------------------

def test_paired_interval_matches_scipy_one_sample_t_on_log_ratios():
    b, c = [100, 104, 98, 101, 103], [108, 113, 105, 110, 109]
    mean, low, high = paired_interval(b, c, 0.9)
    d = np.log(c) - np.log(b)
    ci = stats.ttest_1samp(d, 0).confidence_interval(0.9)
    assert (mean, low, high) == pytest.approx((d.mean(), ci.low, ci.high))


def test_welch_interval_matches_scipy_welch_on_log_values():
    b, c = [100, 104, 98, 101], [108, 120, 105, 110, 109]
    mean, low, high = welch_interval(b, c, 0.95)
    ci = stats.ttest_ind(np.log(c), np.log(b), equal_var=False).confidence_interval(0.95)
    assert (low, high) == pytest.approx((ci.low, ci.high))
    assert mean == pytest.approx(np.log(c).mean() - np.log(b).mean())


@pytest.mark.parametrize("low, high, verdict", [
    (0.03, 0.2, "keep"), (0.01, 0.2, None), (-0.1, -0.001, "regressed"),
    (-0.01, 0.015, "no_gain"), (-0.05, 0.019, "no_gain"), (-0.05, 0.05, None),
])
def test_verdict_for_interval(low, high, verdict):
    assert verdict_for(low, high, 0.02) == verdict


def test_zero_min_gain_never_says_no_gain():
    assert verdict_for(-0.01, 0.01, 0.0) is None
    assert verdict_for(-0.02, -0.01, 0.0) == "regressed"


# stat judge ------------------------------------------------------------------------------------

BASE = [100.0, 101.0, 99.0, 100.5, 99.5, 100.2, 99.8, 100.1]


def test_stat_keeps_a_clear_gain_at_min_pairs():
    judge = Judge(policy(min_pairs=3))
    assert judge.decide(BASE[:2], [110, 111], final=False) is None
    d, n = judge_sequence(judge, BASE, [b * 1.10 + (i % 2) for i, b in enumerate(BASE)])
    assert (d.verdict, n, d.rule) == ("keep", 3, "stat")
    assert d.gain == pytest.approx(0.10, abs=0.01)
    assert d.ci_low > 0.02 and d.ci_high > d.gain > d.ci_low
    assert d.confidence == 0.95 and d.min_gain == 0.02 and d.notes == []
    assert set(d.to_dict()) >= {"verdict", "gain", "ci_low", "ci_high", "n_baseline", "n_candidate", "rule", "notes"}


def test_stat_rejects_a_five_percent_regression_as_regressed():
    d, n = judge_sequence(Judge(policy()), BASE, [b * 0.95 for b in reversed(BASE)])
    assert d.verdict == "regressed" and d.ci_high < 0 and n <= 4


def test_stat_stops_early_on_a_null_effect():
    cand = [b * (1 + 0.001 * (-1) ** i) for i, b in enumerate(BASE)]
    d, n = judge_sequence(Judge(policy()), BASE, cand)
    assert d.verdict == "no_gain" and n == 3
    assert -0.02 < d.ci_low < d.ci_high < 0.02


def test_stat_inconclusive_only_at_final():
    cand = [b * r for b, r in zip(BASE, [1.06, 0.98, 1.05, 0.99, 1.06, 0.98, 1.04, 0.99])]
    judge = Judge(policy(max_pairs=8))
    for n in range(3, 8):
        assert judge.decide(BASE[:n], cand[:n], final=False) is None
    d = judge.decide(BASE, cand, final=True)
    assert d.verdict == "inconclusive" and d.ci_low < 0.02 < d.ci_high
    assert not judge.keeps(d)
    assert Judge(policy(on_inconclusive="keep")).keeps(d)


def test_stat_treats_max_pairs_as_final():
    cand = [b * r for b, r in zip(BASE, [1.06, 0.98, 1.05, 0.99])]
    assert Judge(policy(max_pairs=4)).decide(BASE[:4], cand, final=False).verdict == "inconclusive"


def test_pairing_cancels_drift_that_sequential_judging_cannot():
    drift = [1 + 0.04 * i for i in range(6)]  # the machine gets 20% faster over the window
    base = [100 * d * (1 + 0.002 * (-1) ** i) for i, d in enumerate(drift)]
    cand = [110 * d * (1 - 0.002 * (-1) ** i) for i, d in enumerate(drift)]
    paired, _ = judge_sequence(Judge(policy(interleave=True, max_pairs=6)), base, cand)
    assert paired.verdict == "keep"
    unpaired, _ = judge_sequence(Judge(policy(interleave=False, max_pairs=6)), base, cand)
    assert unpaired.verdict == "inconclusive"


def test_implausible_gain_is_remeasured_once_then_vetoed():
    judge = Judge(policy(implausible_factor=3.0))
    base, cand = BASE[:5], [400.0, 410.0, 405.0, 402.0, 408.0]
    assert judge.decide(base[:3], cand[:3], final=False) is None
    d = judge.decide(base[:4], cand[:4], final=False)
    assert d.verdict == "keep" and d.n_candidate == 4 and d.implausible
    assert any("implausible" in note and "held" in note for note in d.notes)
    [veto] = implausible_veto(d, policy(implausible_factor=3.0))
    assert "held after re-measuring, beyond implausible_factor 3" in veto
    assert outcome(d, [veto], policy()) == ("rolled_back", "guardrail")


def test_a_plugin_expecting_a_large_gain_raises_the_factor_and_is_kept():
    expecting = policy(implausible_factor=10.0)
    base, cand = BASE[:4], [400.0, 410.0, 405.0, 402.0]
    d, n = judge_sequence(Judge(expecting), base, cand)
    assert (d.verdict, d.implausible, n) == ("keep", False, 3)
    assert implausible_veto(d, expecting) == [] and outcome(d, [], expecting) == ("kept", None)


def test_implausible_gain_that_fades_is_judged_on_the_new_evidence():
    judge = Judge(policy(implausible_factor=3.0))
    base, cand = BASE[:4], [400.0, 410.0, 405.0, 1.0]
    assert judge.decide(base[:3], cand[:3], final=False) is None
    assert judge.decide(base, cand, final=False) is None  # no longer implausible, now too noisy to call


def test_implausible_gain_at_the_last_pair_is_decided_with_a_note():
    judge = Judge(policy(min_pairs=3, max_pairs=3, implausible_factor=3.0))
    d = judge.decide(BASE[:3], [400.0, 410.0, 405.0], final=True)
    assert d.verdict == "keep" and "could not be re-measured" in d.notes[0] and not d.implausible


def test_implausible_slowdown_is_flagged_too():
    judge = Judge(policy(implausible_factor=3.0))
    assert judge.decide(BASE[:3], [20.0, 21.0, 20.5], final=False) is None
    d = judge.decide(BASE[:4], [20.0, 21.0, 20.5, 20.2], final=False)
    assert d.verdict == "regressed" and implausible_veto(d, policy()) == []  # rolled back as regressed, no veto


def test_a_zero_candidate_is_a_regression_at_once():
    d = Judge(policy()).decide(BASE[:1], [0.0], final=False)
    assert d.verdict == "regressed" and d.gain is None and "fell to 0.0" in d.notes[0]
    assert Judge(policy()).decide(BASE[:2], [100.0, float("nan")], final=False).verdict == "regressed"


def test_a_non_positive_baseline_cannot_be_judged_by_ratios():
    d = Judge(policy()).decide([-5.0, -4.0, -6.0], [-1.0, -1.0, -1.0], final=False)
    assert d.verdict == "inconclusive" and "rule: first" in d.notes[0]


def test_bad_samples_and_policies_raise_clear_errors():
    with pytest.raises(ValueError, match="candidate arm"):
        paired_interval(BASE[:3], [100.0, 0.0, 101.0], 0.95)
    # the judge's input is the policy model, which names the bad field
    with pytest.raises(ValueError, match="(?s)^1 validation error for Policy\nrule"):
        Judge(policy(rule="median"))
    with pytest.raises(ValueError, match="(?s)^1 validation error for Policy\nconfidence"):
        Judge(policy(confidence=95))


def test_judge_accepts_the_config_policy_model():
    from orchestrator.policy import Policy

    judge = Judge(Policy(min_gain=0.05, max_pairs=5))
    assert (judge.min_gain, judge.max_pairs, judge.rule) == (0.05, 5, "stat")
    d, _ = judge_sequence(judge, BASE, [b * 1.2 for b in BASE])
    assert isinstance(d, Decision) and d.verdict == "keep" and d.min_gain == 0.05


def test_gain_is_the_geometric_mean_ratio():
    d = Judge(policy(max_pairs=3)).decide([100, 200, 50], [110, 220, 55], final=True)
    assert d.gain == pytest.approx(0.10) and math.isclose(d.ci_low, 0.10) and d.verdict == "keep"


def test_no_samples():
    assert Judge(policy()).decide([], [], final=False) is None
    with pytest.raises(ValueError, match="at least one sample"):
        Judge(policy()).decide([100.0], [], final=True)


# the keep-or-roll-back rule ---------------------------------------------------------------------

@pytest.mark.parametrize("verdict, on_inconclusive, vetoes, expected", [
    ("keep", "rollback", [], ("kept", None)),
    ("keep", "rollback", ["p99_ms: too slow"], ("rolled_back", "guardrail")),
    ("no_gain", "keep", [], ("rolled_back", "no_gain")),
    ("regressed", "keep", ["p99_ms: too slow"], ("rolled_back", "regressed")),
    ("inconclusive", "rollback", [], ("rolled_back", "inconclusive")),
    ("inconclusive", "keep", [], ("kept", "inconclusive")),
    ("inconclusive", "keep", ["p99_ms: too slow"], ("rolled_back", "guardrail")),
])
def test_outcome_is_the_one_keep_or_roll_back_rule(verdict, on_inconclusive, vetoes, expected):
    d = Decision(verdict, 0.1)
    assert outcome(d, vetoes, policy(on_inconclusive=on_inconclusive)) == expected
    assert Judge(policy(on_inconclusive=on_inconclusive)).keeps(d) == (outcome(d, [], policy(
        on_inconclusive=on_inconclusive))[0] == "kept")
