"""The run's between-start spread pooled over its calibration and its decisions (noise.folded): unchanged by a
decision on one pair of servers, unbiased over many, never below the calibration's lower confidence bound, and,
judged by it, fewer false keeps where the calibration was quieter than the states judged after it and more real
keeps where it was noisier. Simulated samples with a fixed seed: lognormal start effects and sample noise."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import chi2

from orchestrator.decide import Judge
from orchestrator.noise import FLOOR_CONFIDENCE, Noise, components, folded
from orchestrator.policy import Policy


class Servers:
    """Fresh simulated servers: each start draws its effect once; each sample adds its own noise."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.count = 0

    def start(self, between: float) -> tuple[int, float]:
        self.count += 1
        return self.count, float(self.rng.normal(0, between))

    def block(self, effect: float, pairs: int, between: float, within: float, kept=None):
        """`pairs` pairs on one candidate server and one kept server (`kept` to reuse one): log ratios, servers."""
        kept = kept or self.start(between)
        cand = self.start(between)
        logs = [math.log1p(effect) + cand[1] - kept[1] + float(self.rng.normal(0, within) - self.rng.normal(0, within))
                for _ in range(pairs)]
        return logs, [(kept[0], cand[0])] * pairs


def calibration(servers: Servers, between: float, within: float, starts: int = 3) -> Noise:
    blocks = [servers.block(0.0, 2, between, within)[0] for _ in range(starts)]
    return components(blocks, kept_restarted=True)


def decision(servers: Servers, effect: float, between: float, within: float, blocks=(2, 1)):
    logs, starts = [], []
    for pairs in blocks:
        more_logs, more_starts = servers.block(effect, pairs, between, within)
        logs += more_logs
        starts += more_starts
    return logs, starts


def test_a_decision_on_one_pair_of_servers_or_on_mixed_kept_servers_changes_nothing():
    noise = Noise(0.02, 0.04, 2)
    assert folded(noise, [0.1, 0.12, 0.08], [(1, 2)] * 3) is noise
    # three blocks, two of them on one kept server: neither model of the block means holds
    assert folded(noise, [0.1, 0.2, 0.3], [(1, 2), (1, 3), (4, 5)]) is noise
    assert folded(Noise(0.02, 0.0, 0), [0.1, 0.3], [(1, 2), (3, 4)]).between_df == 0  # nothing calibrated


@pytest.mark.parametrize("kept_restarted", [True, False])
def test_pooled_over_many_decisions_the_spread_between_starts_is_found(kept_restarted):
    servers = Servers(7)
    true_between, within = 0.04, 0.02
    noise = calibration(servers, true_between, within)
    first = noise
    for _ in range(60):
        if kept_restarted:
            logs, starts = decision(servers, 0.05, true_between, within)
        else:  # one kept server for the whole decision, a fresh candidate for each block (the sleeping pairing)
            kept = servers.start(true_between)
            logs, starts = [], []
            for pairs in (2, 1):
                more_logs, more_starts = servers.block(0.05, pairs, true_between, within, kept=kept)
                logs += more_logs
                starts += more_starts
        noise = folded(noise, logs, starts)
    assert noise.pooled == 60 and noise.between_df == first.between_df + 60
    assert abs(noise.between - true_between) < 0.25 * true_between, (first.between, noise.between)


def test_decisions_quieter_than_the_calibration_tighten_it_down_to_its_lower_bound_only():
    noise = Noise(0.01, 0.05, 2)
    for i in range(20):  # block means that agree exactly: no spread between starts at all
        noise = folded(noise, [0.03, 0.03, 0.03], [(2 * i, 2 * i + 1)] * 2 + [(2 * i + 100, 2 * i + 101)])
    floor = 0.05 * math.sqrt(2 / chi2.ppf(FLOOR_CONFIDENCE, 2))
    assert noise.between == pytest.approx(floor) and 0 < floor < 0.05
    assert noise.raw < floor ** 2 and noise.between_df == 22
    # a noisy decision afterwards moves the pooled estimate from its raw value, not from the floor
    wider = folded(noise, [0.0, 0.0, 0.5], [(1, 2), (1, 2), (3, 4)])
    assert wider.raw > noise.raw and wider.between > floor and wider.floor == noise.floor


def keep_rate(calibrated: float, judged: float, effect: float, pool: bool, runs: int = 60) -> float:
    """The share of kept decisions in `runs` runs of 12 decisions of 2 + 1 pairs (the GPU main job's shape),
    judged after a calibration of 3 starts x 2 pairs whose start effects have sd `calibrated`, the decisions'
    `judged`."""
    servers = Servers(11)
    policy = Policy(rule="stat", min_gain=0.02)
    kept = total = 0
    for _ in range(runs):
        noise = calibration(servers, calibrated, 0.01)
        for _ in range(12):
            logs, starts = decision(servers, effect, judged, 0.01)
            base = [1.0] * len(logs)
            d = Judge(policy, noise).decide(base, [math.exp(x) for x in logs], final=True, starts=starts)
            kept += d.verdict == "keep"
            total += 1
            if pool:
                noise = folded(noise, logs, starts)
    return kept / total


def test_a_calibration_quieter_than_the_decisions_keeps_fewer_no_ops_once_pooled():
    pooled, alone = keep_rate(0.01, 0.04, 0.0, True), keep_rate(0.01, 0.04, 0.0, False)
    assert pooled <= 0.025 < alone, (pooled, alone)


def test_a_calibration_noisier_than_the_decisions_keeps_more_real_gains_once_pooled_and_no_more_no_ops():
    pooled, alone = keep_rate(0.05, 0.01, 0.12, True), keep_rate(0.05, 0.01, 0.12, False)
    assert pooled > 1.5 * alone, (pooled, alone)
    assert keep_rate(0.05, 0.01, 0.0, True) <= 0.01


def test_the_decision_records_the_spread_and_the_degrees_of_freedom_it_counted_its_own_blocks_included():
    noise = Noise(0.01, 0.03, 2)
    noise = folded(noise, [0.1, 0.12, 0.02], [(1, 2), (1, 2), (3, 4)])
    judge = Judge(Policy(rule="stat", min_gain=0.02), noise)
    cand, starts = [1.1, 1.12, 1.02], [(5, 6), (5, 6), (7, 8)]
    d = judge.decide([1.0] * 3, cand, final=True, starts=starts)
    own = folded(noise, [math.log(c) for c in cand], starts)
    assert (d.between, d.between_df) == (own.between, 4) and own.between != noise.between
    one = judge.decide([1.0] * 2, cand[:2], final=True, starts=starts[:2])  # one block: the run's spread as it is
    assert (one.between, one.between_df) == (noise.between, 3)


def test_the_replay_rejudges_a_recorded_run_by_its_calibration_and_by_the_pooled_spread(tmp_path):
    """A history as a run leaves it (its runs, steps and measurements tables): three A/A steps, then two attempts
    on two blocks each; the replay judges both ways, and the second attempt by the spread pooled with the first."""
    import sqlite3

    from benchmarks.replay_pooled import replay

    db = tmp_path / "orchestrator.db"
    conn = sqlite3.connect(db)
    conn.executescript("CREATE TABLE runs (id INTEGER PRIMARY KEY, command TEXT);"
                       "CREATE TABLE steps (id INTEGER PRIMARY KEY, run_id INTEGER, plugin TEXT);"
                       "CREATE TABLE measurements (id INTEGER PRIMARY KEY, run_id INTEGER, step_id INTEGER, "
                       "role TEXT, arm TEXT, repeat INTEGER, ok INTEGER, value REAL, server INTEGER);"
                       "INSERT INTO runs VALUES (1, 'run'), (2, 'calibrate');")
    servers = Servers(3)
    step = 0

    def record(plugin: str, blocks: list[tuple[list[float], list]], run: int = 1) -> None:
        nonlocal step
        step += 1
        conn.execute("INSERT INTO steps VALUES (?, ?, ?)", (step, run, plugin))
        repeat = 0
        for logs, starts in blocks:
            for value, (kept, cand) in zip(logs, starts):
                for arm, v, server in (("baseline", 100.0, kept), ("candidate", 100.0 * math.exp(value), cand)):
                    conn.execute("INSERT INTO measurements (run_id, step_id, role, arm, repeat, ok, value, server) "
                                 "VALUES (?, ?, 'throughput', ?, ?, 1, ?, ?)", (run, step, arm, repeat, v, server))
                repeat += 1

    for i in range(3):
        record(f"(A/A {i + 1})", [servers.block(0.0, 2, 0.03, 0.01)])
    for plugin in ("first", "second"):
        record(plugin, [servers.block(0.1, 2, 0.03, 0.01), servers.block(0.1, 1, 0.03, 0.01)])
    record("(A/A 1)", [servers.block(0.0, 2, 0.5, 0.01)], run=2)  # a later calibrate's own: not this run's
    conn.commit()
    conn.close()
    lines = replay(db, Policy(rule="stat", min_gain=0.02))
    assert lines[0].startswith("calibration: ") and lines[0].endswith("(2 df)"), lines[0]
    first, second = lines[1], lines[2]
    assert first.startswith("first") and first.count("[") == 2 and first.endswith("(2 df)"), first
    assert second.startswith("second") and second.endswith("(3 df)"), second
    assert len(lines) == 3


def test_a_fresh_server_of_the_calibrated_state_lies_within_its_level_and_another_machine_does_not():
    """noise.level_shift: over 2,000 simulated calibrations (start effects 3%, sample noise 5%, 3 fresh servers of
    2 pairs against one kept server) on the machine they calibrated, a fresh server's level passes the bound in
    under 1% of draws; a machine at half the speed passes it, and the bound widens with the start effects the
    calibration allows."""
    from orchestrator.noise import ceiling, level_shift

    rng = np.random.default_rng(7)
    between, within = 0.03, 0.05
    outside = 0
    for _ in range(2000):  # an A/A calibration: 3 fresh servers, 2 pairs each against one kept server
        kept = np.exp(rng.normal(0, between) + rng.normal(0, within, 6))
        fresh_servers = [np.exp(rng.normal(0, between) + rng.normal(0, within, 2)) for _ in range(3)]
        blocks = [list(np.log(c / kept[2 * i:2 * i + 2])) for i, c in enumerate(fresh_servers)]
        noise = components(blocks, kept_restarted=False)
        servers = [kept, *fresh_servers]
        fresh = np.exp(rng.normal(0, between) + rng.normal(0, within, 2))
        shift, bound = level_shift(servers, fresh, noise)
        outside += abs(shift) > bound
    assert outside / 2000 < 0.01
    noise = Noise(within=within, between=between, between_df=2)
    half = np.exp(np.log(0.5) + rng.normal(0, within, 2))
    shift, bound = level_shift([[1.0, 1.02], [0.98, 1.01], [1.03, 0.99]], half, noise)
    assert abs(shift - math.log(0.5)) < 0.1 and abs(shift) > bound
    wider = Noise(within=within, between=0.2, between_df=2)
    assert level_shift([[1.0]], [1.0], wider)[1] > level_shift([[1.0]], [1.0], noise)[1] > 3 * ceiling(noise)
    with pytest.raises(ValueError):
        level_shift([], [1.0], noise)
