"""What a sleep and a wake do to a server's level, told from the samples of servers that sleep between their
samples as the sleeping pairing's do (noise.wake_spread), and whether woken servers may stand in for the servers
they were (noise.wakes_like_fresh)."""
from __future__ import annotations

import math

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
