"""Keep-or-rollback decisions from throughput samples of a baseline arm and a candidate arm.

Two rules share one interface. ``first`` is the original fixed-sample rule, for tests. ``stat`` is an
adaptive judge: it works on log ratios of the objective so that effects are relative and
multiplicative noise is symmetric, and it stops as soon as a confidence interval of the effect
settles the question. With interleaved arms (baseline i and candidate i measured back to back)
each pair's log ratio cancels drift that is slow compared with one pair, so the judge uses a
paired t interval; without interleaving it falls back to Welch's interval on the log values.

Pairs taken on the same two live servers share those servers' start effects, which no number of
pairs averages away. Given the noise an A/A calibration measured (noise.py) and the server each
sample came from, the paired interval adds the start effects the pairs carry, pooled with what this
decision's own blocks of servers show: the interval is as wide as the evidence, whether the pairs
came from one pair of servers or several. A keep on one pair of servers that the start effects the
run cannot yet rule out could explain is confirmed on fresh servers first (``Judge.doubt``,
``Judge.until_decided``). See docs/decisions.md for why these were chosen over Mann-Whitney U.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any, Callable, Hashable, Sequence

import numpy as np
from scipy import stats

from orchestrator.noise import Noise, ceiling, folded
from orchestrator.policy import Policy

VERDICTS = ("keep", "no_gain", "regressed", "inconclusive")

# A pair's two servers: (the baseline sample's, the candidate sample's), any hashable label of a server's life.
Starts = Sequence[tuple[Hashable, Hashable]]
# Pair n from a pairing, a block of fresh servers first where asked: (baseline value, candidate value, servers).
Take = Callable[[int, bool], tuple[float, float, tuple[Hashable, Hashable]]]


@dataclass
class Decision:
    verdict: str  # one of VERDICTS
    gain: float | None  # relative effect of the candidate: median ratio (first) or geometric-mean ratio (stat), minus 1
    ci_low: float | None = None
    ci_high: float | None = None
    n_baseline: int = 0
    n_candidate: int = 0
    baseline_median: float | None = None
    candidate_median: float | None = None
    rule: str = "first"
    notes: list[str] = field(default_factory=list)
    confidence: float | None = None
    min_gain: float | None = None
    starts: list[int] | None = None  # server starts behind the pairs: [baseline arm, candidate arm]
    between: float | None = None  # the start-to-start sd the interval counts, when it counts one (noise.py)
    between_df: int | None = None  # its degrees of freedom: the calibration's, and the decisions' it pooled
    implausible: bool = False  # the effect stayed beyond implausible_factor after re-measuring

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_rule(baseline: Sequence[float], candidate: Sequence[float], min_gain: float) -> Decision:
    """Keep when the median gain reaches ``min_gain`` and every candidate sample beats every baseline sample."""
    b_med, c_med = statistics.median(baseline), statistics.median(candidate)
    gain = (c_med - b_med) / abs(b_med) if b_med else float("inf")
    if gain >= min_gain and min(candidate) > max(baseline):
        verdict = "keep"
    elif gain <= -min_gain:
        verdict = "regressed"
    else:
        verdict = "no_gain"
    return Decision(verdict, gain, n_baseline=len(baseline), n_candidate=len(candidate),
                    baseline_median=b_med, candidate_median=c_med, rule="first", min_gain=min_gain)


@lru_cache(maxsize=4096)
def _t_quantile(confidence: float, df: float) -> float:
    """Cached because the judge is called once per pair and scipy's ppf dominates its cost."""
    return float(stats.t.ppf((1 + confidence) / 2, df))


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _logs(samples: Sequence[float], arm: str) -> np.ndarray:
    values = np.asarray(samples, dtype=float)
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"the stat rule needs positive finite objective values; {arm} arm has {list(samples)}")
    return np.log(values)


def paired_interval(baseline: Sequence[float], candidate: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """Mean log ratio of back-to-back pairs with its t interval; drift slower than a pair cancels out."""
    n = min(len(baseline), len(candidate))
    d = _logs(candidate[:n], "candidate") - _logs(baseline[:n], "baseline")
    mean = float(d.mean())
    if n < 2:
        return mean, -math.inf, math.inf
    half = _t_quantile(confidence, n - 1) * float(d.std(ddof=1)) / math.sqrt(n)
    return mean, mean - half, mean + half


def carried_interval(baseline: Sequence[float], candidate: Sequence[float], starts: Starts, noise: Noise,
                     confidence: float) -> tuple[float, float, float]:
    """The paired mean log ratio with an interval that also counts the servers' start effects.

    Each server's start effect (sd ``noise.between``) is in every pair it served: with shares w_s of the pairs
    on candidate server s and v_t on baseline server t, the mean log ratio carries between² (Σ w_s² + Σ v_t²)
    of start variance besides the sample noise (the pair log ratios' variance within blocks of one pair of
    servers, over n). The t quantile takes the Welch-Satterthwaite degrees of freedom of the two parts, the
    start part's being the calibration's."""
    n = min(len(baseline), len(candidate), len(starts))
    d = _logs(candidate[:n], "candidate") - _logs(baseline[:n], "baseline")
    mean = float(d.mean())
    if n < 2:
        return mean, -math.inf, math.inf
    blocks: dict[Hashable, list[float]] = {}
    for pair, value in zip(starts[:n], d):
        blocks.setdefault(pair, []).append(float(value))
    df_w = n - len(blocks)
    if len(blocks) > 1 and df_w >= 1:
        s2 = sum(float(((np.asarray(v) - np.mean(v)) ** 2).sum()) for v in blocks.values()) / df_w
    else:
        s2, df_w = float(d.var(ddof=1)), n - 1
    var_w = s2 / n
    shares = [c / n for arm in (0, 1) for c in Counter(p[arm] for p in starts[:n]).values()]
    var_b = noise.between ** 2 * sum(w * w for w in shares)
    se2 = var_w + var_b
    if se2 == 0:
        return mean, mean, mean
    parts = [(var_w, df_w)] + ([(var_b, noise.between_df)] if var_b > 0 and noise.between_df else [])
    df = se2 ** 2 / sum(v * v / f for v, f in parts)
    half = _t_quantile(confidence, df) * math.sqrt(se2)
    return mean, mean - half, mean + half


def welch_interval(baseline: Sequence[float], candidate: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """Difference of mean log values with Welch's interval, for arms measured one after the other."""
    lb, lc = _logs(baseline, "baseline"), _logs(candidate, "candidate")
    mean = float(lc.mean() - lb.mean())
    if len(lb) < 2 or len(lc) < 2:
        return mean, -math.inf, math.inf
    vb, vc = lb.var(ddof=1) / len(lb), lc.var(ddof=1) / len(lc)
    se = math.sqrt(vb + vc)
    if se == 0:
        return mean, mean, mean
    df = (vb + vc) ** 2 / (vb ** 2 / (len(lb) - 1) + vc ** 2 / (len(lc) - 1))
    half = _t_quantile(confidence, df) * se
    return mean, mean - half, mean + half


def verdict_for(low: float, high: float, min_gain: float) -> str | None:
    """Map an interval of the log effect to a verdict, or None while it settles nothing.

    keep: the whole interval clears log(1 + min_gain). regressed: it lies below 0 (or below
    log(1 + min_gain) when min_gain is negative, a non-inferiority margin): the candidate is
    slower by any amount, which stops a -5% change early. no_gain: it lies below the bar but
    not below 0, so no number of further pairs is expected to make the candidate keepable.
    """
    bar = math.log1p(min_gain)
    if low > bar:
        return "keep"
    if high < min(0.0, bar):
        return "regressed"
    if high < bar:
        return "no_gain"
    return None


class Judge:
    """Adaptive judge: called after each new pair of samples; returns None while more samples are needed.

    Call ``decide`` once per new pair with ``final=True`` on the last allowed one; from
    ``max_pairs`` on every call is final. The judge keeps no state between calls. With ``noise`` (a
    calibration) and the servers behind each pair (``starts``), the interval counts their start effects.
    """

    def __init__(self, policy: Policy, noise: Noise | None = None):
        self.policy = policy
        self.noise = noise
        self.rule = policy.rule
        self.min_gain = float(policy.min_gain)
        self.confidence = float(policy.confidence)
        self.min_pairs = max(2, policy.min_pairs)
        self.max_pairs = max(self.min_pairs, policy.max_pairs)
        self.implausible_factor = float(policy.implausible_factor)
        self.interleave = policy.interleave

    def keeps(self, decision: Decision) -> bool:
        """Whether the deployment keeps the candidate, guardrails aside (see ``outcome``)."""
        return outcome(decision, (), self.policy)[0] == "kept"

    def decide(self, baseline: Sequence[float], candidate: Sequence[float], final: bool,
               starts: Starts | None = None, plan: tuple[int, int] | None = None) -> Decision | None:
        """`plan`: (pairs, blocks of fresh servers) the comparison may take in all; with it, a comparison that
        cannot settle within them stops early, `inconclusive` (see ``futile``)."""
        n = min(len(baseline), len(candidate))
        if n == 0:
            if final:
                raise ValueError("a decision needs at least one sample in each arm")
            return None
        if self.rule == "first":
            if not final and n < self.policy.repeats:
                return None
            return first_rule(baseline, candidate, self.min_gain)
        final = final or n >= self.max_pairs
        invalid = self._invalid(baseline, candidate)
        if invalid is not None:
            return invalid
        if n < self.min_pairs and not final:
            return None
        noise = self.noise_for(baseline, candidate, starts)
        mean, low, high = self._interval(baseline, candidate, starts, noise)
        notes: list[str] = []
        held = False
        if self._implausible(mean):
            prior = (self._interval(baseline[:n - 1], candidate[:n - 1], starts[:n - 1] if starts else None,
                                    noise)[0] if n - 1 >= self.min_pairs else None)
            if prior is None or not self._implausible(prior):
                if not final:
                    return None
                notes.append(f"implausible effect x{math.exp(mean):.3g} (factor {self.implausible_factor:g}) "
                             "could not be re-measured: pair budget spent")
            else:
                held = True
                notes.append(f"implausible effect x{math.exp(mean):.3g} (factor {self.implausible_factor:g}) "
                             "held after re-measuring")
        verdict = verdict_for(low, high, self.min_gain)
        if verdict is None and not final and plan is not None and self.futile(baseline, candidate, starts, plan, mean,
                                                                               noise):
            notes.append(f"stopped after {n} of at most {plan[0]} pairs: even at the budget's end the interval "
                         f"could not be expected to leave the bar of {self.min_gain:+.1%}")
            final = True
        if verdict is None:
            if not final:
                return None
            verdict = "inconclusive"
        counted = self._counts_starts(starts, noise)
        return Decision(
            verdict, math.expm1(mean),
            ci_low=math.expm1(low) if math.isfinite(low) else None,
            ci_high=math.expm1(high) if math.isfinite(high) else None,
            n_baseline=len(baseline), n_candidate=len(candidate),
            baseline_median=statistics.median(baseline), candidate_median=statistics.median(candidate),
            rule="stat", notes=notes, confidence=self.confidence, min_gain=self.min_gain,
            starts=[len({p[0] for p in starts[:n]}), len({p[1] for p in starts[:n]})] if starts else None,
            between=noise.between if counted else None, between_df=noise.between_df if counted else None,
            implausible=held)

    def noise_for(self, baseline: Sequence[float], candidate: Sequence[float], starts: Starts | None) -> Noise | None:
        """The run's noise with this decision's own blocks of servers folded in (noise.folded), as the run folds
        them after it: a fresh block that measures apart from the first widens this decision's interval at once."""
        if self.noise is None or not starts:
            return self.noise
        n = min(len(baseline), len(candidate), len(starts))
        logs = _logs(candidate[:n], "candidate") - _logs(baseline[:n], "baseline")
        return folded(self.noise, [float(x) for x in logs], list(starts[:n]))

    def doubt(self, baseline: Sequence[float], candidate: Sequence[float], starts: Starts | None) -> float | None:
        """The start effects that could explain a keep on a single candidate server: the run's upper bound of them
        (noise.ceiling) where the keep's interval does not clear the bar counting start effects that large; None
        where the keep stands without a block of fresh servers. A calibration that says little of the starts (few
        blocks of noisy pairs) may estimate them at 0, and one pair of servers whose start effects differ by a few
        percent then looks like a gain of a few percent, however many pairs it takes. The fresh block decides the
        keep, and the run pools its spread."""
        if not (self.rule == "stat" and self.interleave and starts and self.noise is not None
                and self.noise.between_df):
            return None
        n = min(len(baseline), len(candidate), len(starts))
        if n < 2 or len({pair[1] for pair in starts[:n]}) > 1:
            return None
        noise = self.noise_for(baseline, candidate, starts)
        bound = ceiling(noise)
        # the bound already holds the estimate's uncertainty: counted as known (no degrees of freedom of its own)
        low = carried_interval(baseline, candidate, starts, replace(noise, between=bound, between_df=0),
                               self.confidence)[1]
        return None if low > math.log1p(self.min_gain) else bound

    def until_decided(self, take: Take, per_block: int, budget: int) -> Decision:
        """Pairs from `take` until the judge decides, in blocks of `per_block` on the same servers (each further
        block on fresh ones), at most `budget` pairs. A keep in `doubt` is not returned while the budget has
        a pair left and the policy another block (`max_starts`): the next pair starts a block of fresh servers,
        and the judge decides again on both blocks. The one loop of every pairing (pairing.py) and of the
        calibration's simulations (calibrate.py)."""
        base: list[float] = []
        cand: list[float] = []
        starts: list[tuple[Hashable, Hashable]] = []
        plan = (budget, -(-budget // per_block))
        begun, blocks, confirm = 0, 1, False
        doubted: str | None = None
        while True:
            n = len(base)
            fresh = n > 0 and (confirm or n - begun >= per_block)
            if fresh:
                begun, blocks, confirm = n, blocks + 1, False
            b, c, pair = take(n, fresh)
            base.append(b)
            cand.append(c)
            starts.append(pair)
            d = self.decide(base, cand, final=n + 1 >= budget, starts=starts, plan=plan)
            if d is None:
                continue
            if (d.verdict == "keep" and n + 1 < budget and blocks < self.policy.max_starts
                    and (bound := self.doubt(base, cand, starts)) is not None):
                confirm = True
                doubted = (f"a keep at {d.gain:+.1%} on one pair of servers after {n + 1} pairs, within start "
                           f"effects of {bound:.1%} (90% bound): measured again on fresh servers")
                continue
            if doubted is not None:
                d.notes.append(doubted)
            return d

    def _invalid(self, baseline: Sequence[float], candidate: Sequence[float]) -> Decision | None:
        """A zero or missing objective ends the comparison at once instead of crashing the log-ratio statistics:
        in the candidate it is a regression; in the baseline the objective is not a throughput to compare."""
        bad_b = [v for v in baseline if not _positive(v)]
        bad_c = [v for v in candidate if not _positive(v)]
        if not bad_b and not bad_c:
            return None
        if bad_b:
            verdict, note = "inconclusive", f"baseline objective {bad_b[0]!r} is not a positive number; the stat rule " \
                                            "compares ratios (use rule: first for other objectives)"
        else:
            verdict, note = "regressed", f"candidate objective fell to {bad_c[0]!r}"
        return Decision(verdict, None, n_baseline=len(baseline), n_candidate=len(candidate), rule="stat",
                        notes=[note], confidence=self.confidence, min_gain=self.min_gain)

    def futile(self, baseline: Sequence[float], candidate: Sequence[float], starts: Starts | None,
               plan: tuple[int, int], mean: float, noise: Noise | None = None) -> bool:
        """Whether more pairs are hopeless: the estimate lies within half the interval the whole budget would
        give (its noise as measured so far, `plan[0]` pairs in `plan[1]` blocks) of the bar. Stopping then
        cannot keep a candidate that more pairs would have kept but rarely, and only ever rolls back, so it is
        used only where an inconclusive candidate is rolled back, and from three pairs on (two pairs' spread
        says little of the noise)."""
        n = min(len(baseline), len(candidate))
        pairs, blocks = plan
        if self.policy.on_inconclusive != "rollback" or n < 3 or pairs <= n:
            return False
        d = _logs(candidate[:n], "candidate") - _logs(baseline[:n], "baseline")
        var_w = float(d.var(ddof=1)) / pairs
        noise = noise if noise is not None else self.noise
        var_b = 2 * noise.between ** 2 / max(1, blocks) if self._counts_starts(starts, noise) else 0.0
        parts = [(var_w, pairs - 1)] + ([(var_b, noise.between_df)] if var_b > 0 else [])
        se2 = var_w + var_b
        if se2 == 0:
            return False
        df = se2 ** 2 / sum(v * v / f for v, f in parts)
        half = _t_quantile(self.confidence, df) * math.sqrt(se2)
        return abs(mean - math.log1p(self.min_gain)) < half / 2

    def _counts_starts(self, starts: Starts | None, noise: Noise | None) -> bool:
        return bool(self.interleave and starts and noise is not None and noise.between > 0)

    def _interval(self, baseline: Sequence[float], candidate: Sequence[float],
                  starts: Starts | None, noise: Noise | None) -> tuple[float, float, float]:
        if not self.interleave:
            return welch_interval(baseline, candidate, self.confidence)
        if self._counts_starts(starts, noise):
            return carried_interval(baseline, candidate, starts, noise, self.confidence)
        return paired_interval(baseline, candidate, self.confidence)

    def _implausible(self, log_effect: float) -> bool:
        return abs(log_effect) > math.log(self.implausible_factor)


def implausible_veto(decision: Decision | None, policy: Policy) -> list[str]:
    """A gain that stayed beyond ``implausible_factor`` after re-measuring is vetoed, as a guardrail vetoes: a
    probe that did no work measures the same every time, so re-measuring cannot make it believable. A plugin
    expected to multiply throughput says so in its ``accept: {implausible_factor: N}``."""
    if decision is None or not decision.implausible or not decision.gain or decision.gain <= 0:
        return []
    return [f"implausible gain {decision.gain:+.4g} (x{decision.gain + 1:.3g}) held after re-measuring, beyond "
            f"implausible_factor {policy.implausible_factor:g}; a plugin expected to have such an effect sets "
            "accept: {implausible_factor: N}"]


def outcome(decision: Decision, vetoes: Sequence[str], policy: Policy) -> tuple[str, str | None]:
    """The keep-or-roll-back rule, applied to every judged candidate: ``("kept", reason)`` or ``("rolled_back", reason)``.

    ``keep`` is kept (no reason). ``inconclusive`` is rolled back, or kept with reason ``inconclusive`` when
    ``on_inconclusive`` is ``keep``. A guardrail veto turns a keep into ``rolled_back: guardrail``. Otherwise
    the verdict is the reason: ``no_gain``, ``regressed`` or ``inconclusive``.
    """
    if decision.verdict == "keep":
        reason = None
    elif decision.verdict == "inconclusive" and policy.on_inconclusive == "keep":
        reason = "inconclusive"
    else:
        return "rolled_back", decision.verdict if decision.verdict in ("no_gain", "regressed") else "inconclusive"
    if vetoes:
        return "rolled_back", "guardrail"
    return "kept", reason
