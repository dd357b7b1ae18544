"""What a sleep and a wake do to a server's level, told from the samples of servers that sleep between their
samples as the sleeping pairing's do (noise.wake_spread), and whether woken servers may stand in for the servers
they were (noise.wakes_like_fresh)."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from orchestrator.noise import Noise, wake_spread, wakes_like_fresh

WITHIN, BETWEEN = 0.01, 0.058


def samples(wake_sd: float, seed: int, servers: int = 4, segments: int = 4, per_segment: int = 2):
    """(server, segment, time, value) of servers that each serve `segments` spells of `per_segment` samples, a
    sleep and a wake between spells; a wake moves the level by a normal step of sd `wake_sd`."""
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    for server in range(servers):
        level = rng.normal(0, BETWEEN)
        for segment in range(segments):
            if segment:
                level += rng.normal(0, wake_sd)
            for _ in range(per_segment):
                t += 1
                out.append((server, segment, t, 1000 * math.exp(level + rng.normal(0, WITHIN))))
    return out


def test_a_wake_that_changes_nothing_is_trusted():
    trusted = 0
    for seed in range(20):
        wake, p, still, same, woken = wake_spread(samples(0.0, seed))
        assert (same, woken) == (16, 12)
        assert wake < 2 * WITHIN and WITHIN / 2 < still < 2 * WITHIN
        trusted += wakes_like_fresh(Noise(WITHIN, BETWEEN, 3, wake=wake, wake_p=p, still=still))
    assert trusted >= 19


def test_a_wake_that_moves_a_server_like_a_start_is_not():
    for seed in range(20):
        wake, p, still, _, _ = wake_spread(samples(BETWEEN * math.sqrt(2), seed))
        assert p < 0.05 and wake > max(still, BETWEEN / 2), (seed, wake, p)
        assert not wakes_like_fresh(Noise(WITHIN, BETWEEN, 3, wake=wake, wake_p=p, still=still))
    # the same wake is no reason to restart where it is small against the spread between starts, or against the
    # noise from one sample to the next (which the pairs' own spread carries)
    wake, p, still, _, _ = wake_spread(samples(BETWEEN * math.sqrt(2), 0))
    assert wakes_like_fresh(Noise(WITHIN, 4 * BETWEEN, 3, wake=wake, wake_p=p, still=still))
    assert wakes_like_fresh(Noise(WITHIN, BETWEEN, 3, wake=wake, wake_p=p, still=4 * BETWEEN))


def test_too_few_samples_tell_nothing_and_are_trusted():
    assert wake_spread(samples(0.05, 0, servers=1, segments=2, per_segment=2)) is None  # one difference of each kind
    assert wakes_like_fresh(Noise(WITHIN, BETWEEN, 3))


def sleeping_calibration(seed: int, slow: int | None, blocks: int = 4, within: float = 0.002):
    """The samples and pair log ratios of a sleeping calibration whose wakes change nothing: one kept server and a
    fresh candidate (level uniform in ±10%) per block, two pairs a block in the order C B, B C, each arm woken
    when its turn comes; sample number `slow` (in time order) is 11% slow, as one hiccup of a busy machine."""
    rng = np.random.default_rng(seed)
    out, logs, t = [], [], 0
    kept_segment = -1
    for block in range(blocks):
        cand = 100 + block
        level = math.log(1 + rng.uniform(-0.1, 0.1))
        kept_segment += 1
        values = {}
        for server, segment, lvl, arm in ((cand, 0, level, "C1"), (0, kept_segment, 0.0, "B1"),
                                          (0, kept_segment, 0.0, "B2"), (cand, 1, level, "C2")):
            value = 1000 * math.exp(lvl + rng.normal(0, within) + (math.log(0.89) if t == slow else 0.0))
            out.append((server, segment, float(t), value))
            values[arm] = value
            t += 1
        logs.append([math.log(values["C1"] / values["B1"]), math.log(values["C2"] / values["B2"])])
    return out, logs


def test_one_slow_sample_is_not_a_wake():
    """Wherever one slow sample falls, woken servers are trusted: the rank test does not take one difference for
    a wake, though the mean squares alone would show a wake larger than both the bars (the CI failure this
    guards against: a sleeping run turned to restarts by one slow sample)."""
    from orchestrator.noise import components

    sized_like_a_wake = 0
    for seed in range(5):
        for slow in range(16):
            samples_, logs = sleeping_calibration(seed, slow)
            wake, p, still, same, woken = wake_spread(samples_)
            assert (same, woken) == (4, 7)
            noise = replace(components(logs, kept_restarted=False), wake=wake, wake_p=p, still=still)
            between = noise.between
            assert wakes_like_fresh(noise), (seed, slow, noise)
            sized_like_a_wake += wake > max(still, between / 2)
    assert sized_like_a_wake >= 20  # the sizes alone would have restarted in many of these runs


def test_a_wake_that_moves_every_server_is_seen_in_a_sleeping_calibration():
    """The same calibration where every wake moves the woken server by a fresh start's draw: not trusted."""
    seen = 0
    for seed in range(20):
        rng = np.random.default_rng(1000 + seed)
        samples_, _ = sleeping_calibration(seed, None)
        shift = {}  # each wake draws the server's level anew
        moved = [(s, seg, t, v * shift.setdefault((s, seg), math.exp(rng.normal(0, 0.08)) if seg else 1.0))
                 for s, seg, t, v in samples_]
        wake, p, still, _, _ = wake_spread(moved)
        seen += not wakes_like_fresh(Noise(0.002, 0.058, 3, wake=wake, wake_p=p, still=still))
    assert seen >= 15, seen


def fresh_servers(bias: float, seed: int, servers: int = 5, per_server: int = 3, sd: float = 0.03):
    """(server, time, value, fresh) of `servers` fresh servers sampled `per_server` times each, the first sample of
    each `bias` off its level (a warm-up that did not finish), and one kept server sampled throughout whose first
    sample here is not its first."""
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    for server in range(1, servers + 1):
        level = rng.normal(0, BETWEEN)
        for k in range(per_server):
            t += 1
            out.append((server, t, 1000 * math.exp(level + rng.normal(0, sd) + (math.log1p(bias) if k == 0 else 0)),
                        k == 0))
            out.append((0, t + 0.5, 1000 * math.exp(rng.normal(0, sd)), False))
    return out


def test_a_first_sample_that_runs_slow_on_every_fresh_server_is_shown():
    """Found on one H100: after a fixed 3-s warm-up the first 10-s window on each fresh vLLM server measured 18.5%
    below the later ones. Five fresh servers, each first sample 18.5% slow, 3% noise: shown, and about that size;
    the kept server, whose first sample in the calibration is not its first, does not count."""
    from orchestrator.noise import first_window, first_window_biased

    for seed in range(20):
        first = first_window(fresh_servers(-0.185, seed))
        assert first_window_biased(first) and first["servers"] == 5, (seed, first)
        assert abs(first["mean"] + 0.185) < 0.06 and first["high"] < -0.05, (seed, first)


def test_a_warm_first_sample_is_not_shown_and_too_few_servers_tell_nothing():
    from orchestrator.noise import first_window, first_window_biased

    shown = sum(first_window_biased(first_window(fresh_servers(0.0, seed))) for seed in range(100))
    assert shown <= 12, shown  # a 95% interval: about 5 of 100
    assert first_window(fresh_servers(-0.3, 0, servers=1)) is None  # one server sampled twice
    assert first_window([(s, t, v, False) for s, t, v, _ in fresh_servers(-0.3, 0)]) is None  # no fresh server


def test_differences_from_a_biased_first_sample_count_for_no_wake():
    """A sleeping calibration (four blocks, C B B C) whose wakes change nothing but whose fresh candidates' first
    samples run 20% slow: every candidate's difference across its wake starts from its first sample, and the wake
    test measures their bias as a wake's effect. Skipped, as calibrate skips them where the first samples are shown
    biased, the wakes measure what they do: nothing."""
    from orchestrator.noise import first_window, first_window_biased

    for seed in range(10):
        samples_, logs = sleeping_calibration(seed, None)
        firsts = {}
        for server, _, t, _ in samples_:
            firsts.setdefault(server, t)
        slowed = [(s, seg, t, v * (0.8 if s and firsts[s] == t else 1.0)) for s, seg, t, v in samples_]
        first = first_window([(s, t, v, bool(s) and firsts[s] == t) for s, _, t, v in slowed])
        assert first_window_biased(first), first
        wake, *_ = wake_spread(slowed)
        assert wake > 0.12, (seed, wake)  # the first samples' 22% in log, spread over the differences across a wake
        skip = {(s, t) for s, _, t, _ in slowed if s and firsts[s] == t}
        wake, p, still, same, woken = wake_spread(slowed, skip)
        assert (same, woken) == (4, 3) and wake < 2 * still, (seed, wake, still)
        assert wakes_like_fresh(Noise(0.002, 0.058, 3, wake=wake, wake_p=p, still=still)), (seed, wake, p)


def test_the_first_samples_line_says_whether_the_warm_up_warmed_the_servers():
    from orchestrator.status import first_window_line

    biased = first_window_line({"mean": -0.185, "low": -0.27, "high": -0.09, "servers": 9})
    assert biased == ("a fresh server's first sample against its next: -18.50% [-27.00%, -9.00%] (9 servers): the "
                      "warm-up did NOT warm them; differences from a first sample count for no wake")
    assert first_window_line({"mean": 0.01, "low": -0.02, "high": 0.04, "servers": 3}).endswith(
        "(3 servers), consistent with a warm server")
    assert first_window_line(None) is None
