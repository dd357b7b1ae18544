"""Two levels of noise in a throughput objective, and the measurement design they call for.

A server's start fixes part of its speed for its whole life (where the OS and the driver put its memory, which
kernels its autotuner picked, how warm the card was), and each sample adds noise of its own. In logs:

    log(objective) = effect of the state + start effect (sd `between`) + sample noise (sd `within`)

Pairs taken on the same two servers cancel drift, but not the two servers' start effects: however many pairs
they take, their difference stays in every pair. So a decision on one start per arm carries `between` in full,
and only more starts shrink it. `orchestrator calibrate` measures both levels with an A/A test of one state
(calibrate.py); the judge widens its interval by the start effects the pairs carry (decide.py), and
`pairs_per_start` says when fresh servers pay for themselves.

Where servers sleep and wake between their samples (the "sleeping" pairing: one GPU, the kept state's server kept
from candidate to candidate), a wake may move a server's level too. Its spread (`wake`) is measured from the
calibration's samples: consecutive samples of one server with a sleep between them against consecutive ones
without (`wake_spread`). A wake that moves a server about as much as a fresh start would is no cheaper than a
restart and breaks the judge's model of one start effect per server: `wakes_like_fresh` says whether the run may
sleep. A fresh server's first sample comes after the probe's warm-up; `first_window` checks it against the
server's next, since a warm-up that falls short biases every fresh sample (and, across a wake, the wake test).

A calibration has few blocks (three starts give 2 degrees of freedom), and the state it measured may be noisier or
quieter than the states judged after it. Every decision that took two or more blocks of fresh servers measures the
start effects again, so the run folds each into its noise (`folded`): the judge's between-start spread becomes the
pooled estimate of the calibration and the decisions so far, with their degrees of freedom, never below what the
calibration itself allows at 97.5% confidence. Where that estimate is uncertain (a calibration whose samples are
noisy says little of the starts: its estimate may be 0 with an upper bound of 9%), `ceiling` bounds it from above,
and a keep on one pair of servers that start effects that large could explain is confirmed on fresh servers
(decide.Judge.doubt), which also gives the run the blocks it pools. Pure functions, no I/O.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Collection, Hashable, Sequence

import numpy as np


@dataclass(frozen=True)
class Noise:
    within: float  # sd of log(objective) between samples of one server's life
    between: float  # sd of log(objective) between starts of one state
    between_df: int  # degrees of freedom of `between` (A/A blocks - 1)
    start_seconds: float | None = None  # mean time from a server's start to its first answer
    pair_seconds: float | None = None  # mean time of a pair of samples
    calibration: int | None = None  # its id in the history
    wake: float | None = None  # RMS change of log(objective) a sleep and a wake make to one server (sleeping pairing)
    wake_p: float | None = None  # the chance of a `wake` this large were a wake to change nothing (a rank test)
    still: float | None = None  # sd of log(objective) from one sample to the next of a server with no sleep between
    pooled: int = 0  # decisions folded into `between` since the calibration (`folded`)
    floor: float | None = None  # the lowest `between` the calibration allows (set at the first fold)
    raw: float | None = None  # the (pooled) estimate of between² before the floor and 0 (may be negative)
    carried: float | None = None  # the part of the block means' spread the pairs' own noise explains (`spread`)


def spread(blocks: Sequence[Sequence[float]], c: float, pair_ms: float | None = None) -> tuple[float, float, float]:
    """(spread, carried, pair mean square) of blocks of pair log ratios log(candidate / kept), over `c`.

    Within a block a pair's log ratio varies by 2 within² (its mean square within blocks, `pair_ms`: measured from
    the blocks, or given where they have too few pairs); a block's mean varies by c between² + 2 within² / m (m
    pairs; c = 2 when both servers are fresh per block, 1 when the kept one is shared, whose constant start effect
    then cancels between blocks). `spread` is the variance of the block means and `carried` the part of it the
    pairs' own noise explains (both over c): spread - carried estimates between² without bias, as in a one-way
    analysis of variance."""
    arrays = [np.asarray(b, dtype=float) for b in blocks]
    n, k = sum(len(b) for b in arrays), len(arrays)
    if n > k:
        pair_ms = sum(float(((b - b.mean()) ** 2).sum()) for b in arrays) / (n - k)
    if pair_ms is None:
        raise ValueError("the pairs' own noise needs a block of two pairs or more")
    means = np.array([b.mean() for b in arrays])
    return float(means.var(ddof=1)) / c, pair_ms * float(np.mean([1.0 / len(b) for b in arrays])) / c, pair_ms


def components(blocks: Sequence[Sequence[float]], kept_restarted: bool) -> Noise:
    """The noise A/A blocks of pair log ratios log(candidate / kept) measure (`spread`): within, between (a
    negative estimate is 0) and its degrees of freedom, with the unclamped estimate and its carried part, from
    which `ceiling` bounds it.

    Each block holds the pairs of one fresh candidate start against the kept state's server, which serves every
    block unless `kept_restarted` (then each block has a fresh one too)."""
    blocks = [list(b) for b in blocks if len(b)]
    if len(blocks) < 2 or all(len(b) < 2 for b in blocks):
        raise ValueError("calibration needs at least two blocks, one of them with two pairs or more")
    means_spread, carried, pair_ms = spread(blocks, 2.0 if kept_restarted else 1.0)
    raw = means_spread - carried
    return Noise(math.sqrt(pair_ms / 2), math.sqrt(max(0.0, raw)), len(blocks) - 1, raw=raw, carried=carried)


FLOOR_CONFIDENCE = 0.975  # the pooled between-start spread stays above the calibration's lower bound at this level
CEILING_CONFIDENCE = 0.9  # `ceiling`: the start effects a keep on one pair of servers must outgrow, one-sided


def folded(noise: Noise, log_ratios: Sequence[float], starts: Sequence[tuple[Hashable, Hashable]]) -> Noise:
    """`noise` after one more decision: its pairs' log ratios log(candidate / kept) and the servers behind each
    pair (baseline's, candidate's). A decision on one block of servers says nothing of the start effects and
    changes nothing; one of k blocks gives an unbiased estimate of between², as `components` does for A/A blocks,
    from its own pairs' noise (the calibration's where its blocks hold one pair each: the state judged may be
    quieter or noisier than the one calibrated). c = 2 where each block restarted the kept server too, 1 where one
    kept server served every block; a decision that mixed the two is left out. The pooled between² is the
    degrees-of-freedom-weighted mean of the calibration's and these (k - 1 each), floored at the calibration's
    lower confidence bound between² df / chi²(FLOOR_CONFIDENCE, df): a run whose decisions show less spread than
    its calibration tightens its intervals, never below what the calibration makes plausible; one that shows more
    widens them."""
    from scipy.stats import chi2

    blocks: dict[tuple[Hashable, Hashable], list[float]] = {}
    for value, pair in zip(log_ratios, starts):
        blocks.setdefault(tuple(pair), []).append(float(value))
    k = len(blocks)
    kept_servers = len({pair[0] for pair in blocks})
    if k < 2 or kept_servers not in (1, k) or not noise.between_df:
        return noise
    means_spread, carried, _ = spread(list(blocks.values()), 2.0 if kept_servers == k else 1.0,
                                      2 * noise.within ** 2)
    floor = noise.floor if noise.floor is not None else \
        noise.between * math.sqrt(noise.between_df / float(chi2.ppf(FLOOR_CONFIDENCE, noise.between_df)))
    raw = noise.raw if noise.raw is not None else noise.between ** 2
    df = noise.between_df + k - 1
    raw = (noise.between_df * raw + (k - 1) * (means_spread - carried)) / df
    pooled_carried = None if noise.carried is None else (noise.between_df * noise.carried + (k - 1) * carried) / df
    return replace(noise, between=math.sqrt(max(raw, floor ** 2)), between_df=df, pooled=noise.pooled + 1,
                   floor=floor, raw=raw, carried=pooled_carried)


def ceiling(noise: Noise, confidence: float = CEILING_CONFIDENCE) -> float:
    """An upper confidence bound of `between`, never below it. The block means' spread (over c) is a scaled
    chi-square of `between_df` degrees of freedom with mean between² + carried; its upper bound at `confidence`,
    less `carried`, bounds between². A calibration whose pairs are noisy sets a high bound even where its estimate
    is 0: three blocks of two pairs at 5.6% within a start, with an estimate of 0, allow start effects of 9%.
    Where `carried` is not known (a calibration recorded before it was), the chi-square bound of between² alone."""
    from scipy.stats import chi2

    if not noise.between_df:
        return noise.between
    scale = noise.between_df / float(chi2.ppf(1 - confidence, noise.between_df))
    if noise.carried is None or noise.raw is None:
        return noise.between * math.sqrt(scale)
    bound = max(0.0, noise.raw + noise.carried) * scale - noise.carried
    return max(noise.between, math.sqrt(max(0.0, bound)))


LEVEL_Z = 3.0  # `level_shift`: a state's level further than this many sds from its record is another machine's


def level_shift(recorded: Sequence[Sequence[float]], now: Sequence[float], noise: Noise) -> tuple[float, float]:
    """(shift, bound): the mean log objective of `now` (samples of one fresh server) less the state's recorded level
    (`recorded`: its earlier samples, by server, each server's mean weighing alike), and LEVEL_Z sds of that
    difference were the machine the one `noise` calibrated: each server carries a start effect (sd at most
    `ceiling`), each sample its own noise (`within`). A shift past the bound says the calibration measured another
    machine, or this one in another condition, and its noise need not hold here."""
    servers = [np.log(np.asarray(s, dtype=float)) for s in recorded if len(s)]
    if not servers or not len(now):
        raise ValueError("a level needs samples on both sides")
    k = len(servers)
    level = float(np.mean([s.mean() for s in servers]))
    per_sample = 1 / len(now) + float(np.mean([1 / len(s) for s in servers])) / k
    var = ceiling(noise) ** 2 * (1 + 1 / k) + noise.within ** 2 * per_sample
    return float(np.mean(np.log(np.asarray(now, dtype=float)))) - level, LEVEL_Z * math.sqrt(var)


def offset(blocks: Sequence[Sequence[float]], between: float, between_df: int, kept_restarted: bool,
           confidence: float) -> tuple[float, float, float]:
    """(mean, low, high) of log(candidate / kept) over A/A blocks, with its t interval: what a fresh candidate
    server measures against the kept state's, with no change between them. The judge assumes 0. A long-lived server
    that slows with age, or a fresh one that runs ahead, moves it; so does the shared kept server's own start effect,
    which is one draw of sd `between` in every block and is counted here (Welch-Satterthwaite degrees of freedom,
    as the judge's). Where every block restarts the kept server too, the blocks' spread already holds it."""
    from scipy.stats import t as t_dist

    means = np.array([float(np.mean(b)) for b in blocks if len(b)])
    k = len(means)
    mean = float(means.mean())
    if k < 2:
        return mean, -math.inf, math.inf
    var_means = float(means.var(ddof=1)) / k
    parts = [(var_means, k - 1)]
    if not kept_restarted and between > 0 and between_df:
        parts.append((between ** 2, between_df))
    se2 = sum(v for v, _ in parts)
    if se2 == 0:
        return mean, mean, mean
    df = se2 ** 2 / sum(v * v / f for v, f in parts if v > 0)
    half = float(t_dist.ppf((1 + confidence) / 2, df)) * math.sqrt(se2)
    return mean, mean - half, mean + half


def pairs_per_start(noise: Noise, max_pairs: int) -> int:
    """Pairs each block of fresh servers should take before the next block starts; `max_pairs` or more means one
    block for the whole decision.

    k blocks of m pairs, both arms on fresh servers in each, estimate the effect with variance
    (2 between² + 2 within² / m) / k at a cost of k (2 start + m pair) seconds. The product is least at
    m = within / between · sqrt(2 start / pair), the classic optimum of two-stage sampling: the larger the
    start effects against the sample noise, the sooner new servers pay for themselves."""
    if noise.between <= 0:
        return max_pairs
    start = noise.start_seconds if noise.start_seconds and noise.start_seconds > 0 else 1.0
    pair = noise.pair_seconds if noise.pair_seconds and noise.pair_seconds > 0 else 1.0
    m = noise.within / noise.between * math.sqrt(2 * start / pair)
    return max(2, min(max_pairs, round(m)))


def starts_needed(noise: Noise, pairs: int, bar: float, z: float = 1.96) -> int | None:
    """Blocks (fresh servers of both arms, `pairs` pairs each) before a change of no effect is shown to lie below
    the bar `bar` (relative): its interval's half-width under log(1 + bar); None beyond 100."""
    target = math.log1p(bar) / z
    per_block = 2 * noise.between ** 2 + 2 * noise.within ** 2 / pairs
    if per_block == 0:
        return 1
    k = math.ceil(per_block / target ** 2)
    return k if k <= 100 else None


def pairs_needed(noise: Noise, bar: float, z: float = 1.96) -> int | None:
    """Pairs on one pair of servers before a change of no effect shows an interval inside the bar, counting the
    sample noise only (the start effects of those two servers stay in every pair); None beyond 100."""
    target = math.log1p(bar) / z
    if noise.within == 0:
        return 2
    n = math.ceil(2 * noise.within ** 2 / target ** 2)
    return max(2, n) if n <= 100 else None


WAKE_ALPHA = 0.05  # a wake's effect counts as shown below this p


def first_window(samples: Sequence[tuple[object, float, float, bool]], confidence: float = 0.95
                 ) -> dict[str, float] | None:
    """A fresh server's first sample against its next, from samples (server, time, value, fresh): `fresh` marks
    a server's first sample after its start, which the serving probe took after a warm-up (probes/serving.py:
    settle). The warm-up is there to make this 0; where it is not, the first sample of every fresh server is biased
    (on one H100 after a fixed 3-s warm-up: 18.5% slow), which the judge would take for a start effect, and every
    difference from it for a wake's. Returns the mean ratio - 1 with its t interval (`low`, `high`) and the
    servers counted, or None with fewer than two servers sampled twice."""
    from scipy.stats import t as student

    by_server: dict[object, list[tuple[float, float, bool]]] = {}
    for server, at, value, fresh in samples:
        if value and value > 0:
            by_server.setdefault(server, []).append((at, value, fresh))
    logs = []
    for seq in by_server.values():
        seq.sort()
        if len(seq) >= 2 and seq[0][2]:
            logs.append(math.log(seq[0][1] / seq[1][1]))
    if len(logs) < 2:
        return None
    mean, se = float(np.mean(logs)), float(np.std(logs, ddof=1)) / math.sqrt(len(logs))
    half = float(student.ppf(0.5 + confidence / 2, len(logs) - 1)) * se
    return {"mean": math.expm1(mean), "low": math.expm1(mean - half), "high": math.expm1(mean + half),
            "servers": len(logs)}


def first_window_biased(first: dict[str, float] | None) -> bool:
    """Whether a fresh server's first sample was shown to differ from its next (`first_window`'s interval
    excludes 0)."""
    return first is not None and (first["low"] > 0 or first["high"] < 0)


def wake_spread(samples: Sequence[tuple[object, int, float, float]], skip: Collection[tuple[object, float]] = ()
                ) -> tuple[float, float, float, int, int] | None:
    """(wake, p, still, same, woken) from samples (server, segment, time, value): `segment` counts the server's
    wakes before the sample. Consecutive samples of one server within a segment differ by sample noise alone
    (squared log ratio 2 still^2 in the mean); across a wake also by whatever the wake changed (2 still^2 + wake^2).

    wake^2 is the difference of the two mean squares (0 when negative). Whether a wake moved anything is told by
    ranks, not by their ratio: a wake that moves a server's level moves every difference across a wake, while one
    slow sample (a hiccup of the machine) moves the one or two differences it falls in. `p` is the one-sided
    Mann-Whitney p that the squared differences across a wake are the larger. By an F test of the mean squares,
    one slow sample among a calibration's sixteen, falling across a wake, showed a "wake" on a server whose wakes
    changed nothing. A difference from a sample in `skip` (server, time) counts as neither: a fresh server's first
    sample where `first_window_biased`, whose difference to the next is the warm-up's failing, not a wake's. None
    with fewer than two differences of either kind."""
    from scipy.stats import mannwhitneyu

    by_server: dict[object, list[tuple[float, int, float]]] = {}
    for server, segment, at, value in samples:
        if value and value > 0:
            by_server.setdefault(server, []).append((at, segment, value))
    same: list[float] = []
    woken: list[float] = []
    for server, seq in by_server.items():
        seq.sort()
        for (t0, s0, v0), (_, s1, v1) in zip(seq, seq[1:]):
            if (server, t0) not in skip:
                (same if s0 == s1 else woken).append(math.log(v1 / v0) ** 2)
    if len(same) < 2 or len(woken) < 2:
        return None
    p = float(mannwhitneyu(woken, same, alternative="greater").pvalue)
    ms_same, ms_woken = float(np.mean(same)), float(np.mean(woken))
    return math.sqrt(max(0.0, ms_woken - ms_same)), p, math.sqrt(ms_same / 2), len(same), len(woken)


def wakes_like_fresh(noise: Noise) -> bool:
    """Whether a woken server measures like the server it was: unless the calibration showed a wake's effect (p
    below WAKE_ALPHA) larger than both the sample noise of a server that does not sleep (`still`; a smaller one
    the pairs' own spread carries) and half the spread between starts, at which size a wake is much like a fresh
    start that the judge would not count. Unmeasured: trusted."""
    if noise.wake is None or noise.wake_p is None or noise.wake_p >= WAKE_ALPHA:
        return True
    return noise.wake <= max(noise.still or 0.0, noise.between / 2)


# the terms of the serving score (probes/results.py: with_score), each a throughput the score weighs
SCORE_TERMS = (("output", "output_throughput"), ("input", "input_throughput"), ("cached", "cached_throughput"))


def term_metrics(metrics: dict) -> dict:
    """The part of a sample's metrics that score_terms reads: what an A/A block keeps of each sample."""
    return {k: metrics[k] for k in ("score", "score_weights", "score_streamed", *(f for _, f in SCORE_TERMS))
            if k in metrics}


def score_terms(samples: Sequence[tuple[Hashable, dict]]) -> dict[str, float] | None:
    """Where the serving score's spread within a server comes from: {"score": its sd within a server, and each
    weighted term's ("output", "input", "cached")}, relative to the mean score, pooled over the servers that gave
    two samples or more. A prompt counts whole in the window its first token streams in, so the input term moves in
    steps of a prompt; the output term, counted token by token, should not: the two say whether a noisy objective
    is the server's speed or the window's count of prompts; "streamed", where the samples have it, is the spread of
    the score with prompts counted over their streamed tokens instead (probes/results.py: ``score_streamed``). None
    where the samples (server, metrics) carry no score weights, or no server gave two."""
    groups: dict[Hashable, list[dict[str, float]]] = {}
    for server, metrics in samples:
        weights = metrics.get("score_weights")
        if not isinstance(weights, dict) or not isinstance(metrics.get("score"), (int, float)):
            continue
        terms = {"score": float(metrics["score"])}
        for name, field in SCORE_TERMS:
            terms[name] = float(weights.get(name, 0.0)) * float(metrics.get(field) or 0.0)
        if isinstance(metrics.get("score_streamed"), (int, float)):
            terms["streamed"] = float(metrics["score_streamed"])
        groups.setdefault(server, []).append(terms)
    groups = {k: g for k, g in groups.items() if len(g) >= 2}
    if not groups:
        return None
    df = sum(len(g) - 1 for g in groups.values())
    mean_score = float(np.mean([t["score"] for g in groups.values() for t in g]))
    out = {}
    streamed = all("streamed" in t for g in groups.values() for t in g)
    for name in ("score", *(n for n, _ in SCORE_TERMS), *(("streamed",) if streamed else ())):
        squares = sum(float(np.sum((np.array([t[name] for t in g]) - np.mean([t[name] for t in g])) ** 2))
                      for g in groups.values())
        out[name] = math.sqrt(squares / df) / mean_score
    return out

