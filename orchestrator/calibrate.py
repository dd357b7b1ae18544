"""An A/A test of one state: how much a throughput objective moves within a server's life and from one start to the
next, and what that means for the run's decisions.

`starts` fresh candidate servers of the state on disk are each measured for `pairs` pairs against the kept arm,
exactly as a candidate would be (pairing.py): the kept state's server lives through all of them where the target
keeps one alive, else each block has fresh servers on both sides. Each block is recorded as a step of kind
`calibration` with its A/A decision: that block judged like a candidate, by the noise the other blocks measured
(leave one out, so that no block judges itself). From all blocks: the spread of log(objective) within a start
and between starts (noise.components), the pairs a block should take (noise.pairs_per_start), the starts and
pairs a change of no effect needs before its interval lies inside the bar, the false-keep rate of the
judge's rule under that noise, simulated with and without counting the start effects, and the offset of fresh
servers against the kept one (noise.offset), which the judge takes for 0: where its interval excludes 0, a warning
and the keep rate of a change of no effect that measures like it. Where the servers sleep
and wake between their samples (the sleeping pairing), also how much a wake moves a server (noise.wake_spread) and
whether woken servers may stand in for fresh ones (noise.wakes_like_fresh); the mean sleep and wake time of a
pair is counted in its time. Whatever the pairing, whether a fresh server's first sample, taken after the probe's
warm-up, measures like its next (noise.first_window): where it does not, a warning, and its differences count for
no wake.

Each block is recorded as it ends (the history's calibration_blocks), so that a run cut short mid-calibration (its
machine taken back, a signal) leaves what it measured to the run that continues it (loop.continued): that run
measures only the blocks still missing, of the same kept state in the same environment. A carried block's kept
server, where one lives through the blocks, is the earlier run's: its start then counts in the spread between
starts, which can only widen the intervals judged by it.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from orchestrator import decide
from orchestrator.context import RunContext
from orchestrator.kept import KeptState
from orchestrator.noise import (Noise, ceiling, components, first_window, first_window_biased, level_shift, offset,
                                pairs_needed, pairs_per_start, score_terms, starts_needed, term_metrics, wake_spread,
                                wakes_like_fresh)
from orchestrator.pairing import Together, choose
from orchestrator.policy import Policy
from orchestrator.prober import Arm, Prober, Sample, fingerprint
from orchestrator.state_server import StateServer
from orchestrator.store import loads

KIND = "calibration"
SIMULATIONS = 2000


def label(block: int) -> str:
    return f"(A/A {block + 1})"


def calibrate(run: RunContext, prober: Prober, kept: KeptState, starts: int, pairs: int,
              carry: Sequence[int] = ()) -> Noise:
    """Run the A/A blocks on the state on disk (the kept state), record the calibration and return its noise. The
    blocks of this calibration that the runs in `carry` (cut short before it) measured count as measured."""
    store = run.store
    policy = run.project.policy.model_copy(update=dict(interleave=True, rule="stat", min_pairs=pairs, max_pairs=pairs,
                                                       pairs_per_start=pairs, max_starts=1, calibrate=None))
    pairing = choose(prober, policy, None, None)
    mode = pairing.mode
    kept.arm.show = None
    blocks = carried(store, carry, prober.objective, mode, pairs, kept.arm.holding)[:starts]
    samples = [Sample(x["value"], x["terms"], x["server"], x["segment"], x["at"], x["fresh"])
               for b in blocks for x in b["samples"]]  # every judged sample
    metrics = [(x.server, x.metrics) for x in samples]  # (server, metrics) of every judged sample
    if blocks:
        store.event(run.run_id, "calibration", f"A/A: {len(blocks)} block(s) measured by the run(s) this one "
                    f"continues ({', '.join(str(r) for r in carry)}) count; {starts - len(blocks)} to measure")
    for j in range(len(blocks), starts):
        step_id = store.new_step(run.run_id, label(j), "measuring", kind=KIND, objective=prober.objective)
        cand = Arm(list(kept.arm.holding))
        if isinstance(pairing, Together):
            cand.server = StateServer(run, pinned=mode)
        elif mode == "sequential":  # one state on disk: a fresh server at each change of arm, as a candidate has
            kept.arm.show = cand.show = prober.release
        try:
            verdict = pairing.measure(step_id, label(j), kept.arm, cand)
        finally:
            if cand.server is not None:
                cand.server.stop()
            prober.release()
        logs = [math.log(c.value / b.value) for b, c in zip(verdict.base, verdict.cand)]
        judged = [*verdict.base, *verdict.cand]
        samples += judged
        metrics += [(x.server, x.metrics) for x in judged]
        blocks.append({"step": step_id, "run": run.run_id, "holding": list(kept.arm.holding), "logs": logs,
                       "finished": time.time(), "base": [s.value for s in verdict.base],
                       "cand": [s.value for s in verdict.cand],
                       "starts": [[b.server, c.server] for b, c in zip(verdict.base, verdict.cand)],
                       "samples": [{"value": x.value, "server": x.server, "segment": x.segment, "at": x.at,
                                    "fresh": x.fresh, "terms": term_metrics(x.metrics)} for x in judged]})
        store.add_calibration_block(run.run_id, step_id, prober.objective, mode, pairs, blocks[-1], fingerprint())
    kept.arm.show = None
    kept_restarted = mode in ("simultaneous", "sequential")
    measured = components([b["logs"] for b in blocks], kept_restarted)
    within, between, df = measured.within, measured.between, measured.between_df
    steps = [b["step"] for b in blocks]
    start_s, pair_s = costs(store, [(b["run"], b["step"]) for b in blocks])
    first = first_window([(x.server, x.at, x.value, x.fresh) for x in samples], run.project.policy.confidence)
    biased = first_window_biased(first)
    if biased:
        run.store.event(run.run_id, "warning", f"A/A: a fresh server's first sample measured {first['mean']:+.2%} "
                        f"[{first['low']:+.2%}, {first['high']:+.2%}] against its next ({first['servers']} servers): "
                        "the warm-up did not warm the servers, and every decision's fresh samples carry it")
    wake = None
    if mode == "sleeping":
        switched = [seconds for server in run.sleepers for step, _, seconds in server.switches if step in steps]
        if pair_s is not None and switched:  # a pair's switch of arm: one server sleeps, the other wakes
            pair_s += sum(switched) / (pairs * sum(b["run"] == run.run_id for b in blocks))
        skip = {(x.server, x.at) for x in samples if x.fresh} if biased else set()
        wake = wake_spread([(x.server, x.segment, x.at, x.value) for x in samples], skip)
    spread, p, still = wake[:3] if wake else (None, None, None)
    noise = replace(measured, start_seconds=start_s, pair_seconds=pair_s, wake=spread, wake_p=p, still=still)
    summary = judged_blocks(run, prober, blocks, kept_restarted, run.project.policy)
    per_block = pairs_per_start(noise, run.project.policy.max_pairs)
    policy = run.project.policy
    bar = policy.min_gain
    simulated = simulate(noise, policy, per_block, kept_restarted)
    shift = offset([b["logs"] for b in blocks], between, df, kept_restarted, policy.confidence)
    fresh = {"mean": math.expm1(shift[0]), "low": math.expm1(shift[1]) if math.isfinite(shift[1]) else None,
             "high": math.expm1(shift[2]) if math.isfinite(shift[2]) else None}
    if fresh["low"] is not None and (fresh["low"] > 0 or fresh["high"] < 0):
        # a change of no effect measured like the A/A blocks: how often the run's rule would keep it
        fresh["keep_rate"] = simulate(noise, policy, per_block, kept_restarted, effect=fresh["mean"],
                                      trials=SIMULATIONS // 4)["keep_rate_counting"]
        run.store.event(run.run_id, "warning", f"A/A: fresh servers of the state measured {fresh['mean']:+.2%} "
                        f"[{fresh['low']:+.2%}, {fresh['high']:+.2%}] against the kept state's server, which the judge "
                        f"takes for 0: a change of no effect with that offset is kept in {fresh['keep_rate']:.0%} of "
                        "simulated decisions")
    summary.update(
        pairs_per_start=per_block, pairs_needed=pairs_needed(noise, bar), starts_needed=starts_needed(noise, per_block, bar),
        simulated=simulated, fresh_offset=fresh, blocks=[{k: b[k] for k in ("base", "cand", "starts")} for b in blocks],
        raw=noise.raw, carried=noise.carried, ceiling=ceiling(noise), terms=score_terms(metrics), first_window=first,
        holding=list(kept.arm.holding))
    if mode == "sleeping":
        summary["wake"] = {"spread": noise.wake, "p": noise.wake_p, "still": noise.still,
                           "like_fresh": wakes_like_fresh(noise), "same": wake[3] if wake else 0,
                           "woken": wake[4] if wake else 0,
                           "switch_seconds": statistics.mean(switched) if switched else None}
    calibration_id = store.add_calibration(run.run_id, objective=prober.objective, pairing=mode, starts=starts,
                                           pairs=pairs, within_sd=within, between_sd=between, between_df=df,
                                           start_seconds=start_s, pair_seconds=pair_s, summary=summary,
                                           fingerprint=fingerprint())
    return replace(noise, calibration=calibration_id)


def carried(store, runs: Sequence[int], objective: str | None, pairing: str, pairs: int,
            holding: Sequence[str]) -> list[dict]:
    """The A/A blocks these runs measured of a calibration like this one (the objective, pairing, pairs and kept
    state) that none of them finished, in the environment measured now, oldest first."""
    from orchestrator.fingerprint import environment, is_stale
    finished = {(c["run_id"], c["pairing"]) for c in store.calibrations()}
    current, out = None, []
    for row in store.calibration_blocks(runs):
        block = loads(row["block"])
        if ((row["objective"], row["pairing"], row["pairs"]) != (objective, pairing, pairs)
                or (row["run_id"], row["pairing"]) in finished or block["holding"] != list(holding)):
            continue
        current = current or environment()
        recorded = loads(row["fingerprint"])
        if not (recorded and is_stale(recorded, current)):
            out.append(block)
    return out


def judged_blocks(run: RunContext, prober: Prober, blocks: list[dict], kept_restarted: bool,
                  policy: Policy) -> dict[str, Any]:
    """Each block's A/A decision, by the noise of the others (its step's decision and outcome; a block carried from
    an earlier run is judged, and its step, which that run's end recorded, left as it is)."""
    kept = 0
    for j, block in enumerate(blocks):
        others = [b["logs"] for i, b in enumerate(blocks) if i != j]
        try:
            noise = components(others, kept_restarted)
        except ValueError:  # two blocks: one left cannot say how starts differ
            noise = None
        starts = [tuple(s) for s in block["starts"]]
        d = decide.Judge(policy, noise).decide(block["base"], block["cand"], final=True, starts=starts)
        outcome, reason = decide.outcome(d, (), policy)
        kept += outcome == "kept"
        if block["run"] != run.run_id:
            continue
        run.store.add_decision(run.run_id, block["step"], prober.objective, d.to_dict(), [], policy.judging())
        run.store.finish_step(block["step"], "measured", None if outcome == "kept" else reason,
                              f"A/A: the state against itself on a fresh server: {d.verdict}, gain {d.gain:+.2%}"
                              + (f" [{d.ci_low:+.2%}, {d.ci_high:+.2%}]" if d.ci_low is not None else ""),
                              finished=block["finished"], gain=d.gain, before_value=d.baseline_median,
                              after_value=d.candidate_median)
    return {"aa_judged": len(blocks), "aa_kept": kept,
            "aa_carried": [block["step"] for block in blocks if block["run"] != run.run_id]}


def costs(store, steps: list[tuple[int, int]]) -> tuple[float | None, float | None]:
    """Mean seconds from a live server's start to its first health answer, and of a judged pair of samples, over
    the calibration's steps (run id, step id)."""
    servers = [p for r in {r for r, _ in steps} for p in store.servers(r) if (r, p["step_id"]) in steps
               and p.get("ready")]
    start = statistics.mean(p["ready"] - p["started"] for p in servers) if servers else None
    rows = [m for r, s in steps for m in store.measurements(s, r) if m["role"] == "throughput" and m["ok"]
            and "warm-up" not in (m["arm"] or "")]
    pair = 2 * statistics.mean(m["duration"] for m in rows) if rows else None
    return start, pair


def simulate(noise: Noise, policy: Policy, per_block: int, restarted: bool, effect: float = 0.0,
             trials: int = SIMULATIONS, seed: int = 0) -> dict[str, float]:
    """The keep rate of a change of relative `effect` under `noise`, judged by the run's rule (blocks of
    `per_block` pairs on fresh servers, the first block's kept server shared unless `restarted`), counting the
    start effects and, for comparison, ignoring them as a judge without a calibration does."""
    rng = np.random.default_rng(seed)
    policy = policy.model_copy(update=dict(interleave=True, rule="stat"))
    budget = min(policy.max_pairs, per_block * policy.max_starts)
    kept = {"counting": 0, "ignoring": 0}
    for _ in range(trials):
        offset: dict[tuple[str, object], float] = {}
        for way, judge in (("counting", decide.Judge(policy, noise)), ("ignoring", decide.Judge(policy))):
            blocks = [0]

            def take(n: int, fresh: bool):
                blocks[0] += fresh
                block = blocks[0]
                kb = ("k", block if (restarted or block) else "shared")
                cb = ("c", block)
                for key in (kb, cb):
                    if key not in offset:
                        offset[key] = rng.normal(0, noise.between)
                return (math.exp(offset[kb] + rng.normal(0, noise.within)),
                        math.exp(math.log1p(effect) + offset[cb] + rng.normal(0, noise.within)), (kb, cb))

            d = judge.until_decided(take, per_block, budget)
            kept[way] += decide.outcome(d, (), policy)[0] == "kept"
    return {f"keep_rate_{way}": count / trials for way, count in kept.items()} | {"effect": effect}


def latest(store, objective: str | None, pairing: str) -> Noise | None:
    """The newest calibration of this objective and pairing taken in the environment measured now."""
    from orchestrator.fingerprint import environment, is_stale
    current = None
    for row in store.calibrations():
        if row["objective"] != objective or row["pairing"] != pairing:
            continue
        current = current or environment()
        recorded = loads(row["fingerprint"])
        if recorded and is_stale(recorded, current):
            continue
        summary = loads(row["summary"]) or {}
        wake = summary.get("wake") or {}
        return Noise(row["within_sd"], row["between_sd"], row["between_df"], row["start_seconds"], row["pair_seconds"],
                     row["id"], wake.get("spread"), wake.get("p"), wake.get("still"), raw=summary.get("raw"),
                     carried=summary.get("carried"))
    return None


def moved(store, noise: Noise, holding: Sequence[str], values: Sequence[float]) -> str | None:
    """Why the calibration behind `noise` does not hold here, in a line, where `values` (the run's baseline: samples of
    one fresh server of the state on disk, which holds `holding`) lie further from the state's record than that
    noise allows (noise.level_shift); None where they agree, or where the state has no record in this environment.
    Its record: the calibration's samples where it calibrated this state, else those of the server on which the
    state's newest plugin was kept. A history carried to the next machine (benchmarks/vllm_h200, a part per lease)
    brings its calibration along, and one machine of the same fingerprint ran the calibrated state at half the
    speed (BENCHMARKS.md, "Part 2 decided on one H100")."""
    if noise.calibration is None or not values or any(not (v and v > 0) for v in values):
        return None
    found = calibrated_record(store, noise.calibration, holding) or kept_record(store, holding)
    if found is None:
        return None
    by_server, source = found
    shift, bound = level_shift(list(by_server.values()), values, noise)
    if abs(shift) <= bound:
        return None
    level = math.exp(statistics.mean(math.log(v) for vs in by_server.values() for v in vs))
    return (f"the state the run starts from measures {math.expm1(shift):+.1%} against {source} ({shown(level)} over "
            f"{len(by_server)} server(s), here {shown(statistics.median(values))}), beyond the "
            f"{math.expm1(bound):.1%} its noise allows: the machine is not the one calibration {noise.calibration} "
            "measured, or not as it was, and that calibration is not used")


def calibrated_record(store, calibration: int, holding: Sequence[str]) -> tuple[dict, str] | None:
    """The calibration's samples by server, where it calibrated the state that holds `holding`."""
    row = next((c for c in store.calibrations() if c["id"] == calibration), None)
    if row is None:
        return None
    summary = loads(row["summary"]) or {}
    calibrated = summary.get("holding")
    if calibrated is None:  # recorded before the summary named it: its blocks do
        blocks = store.calibration_blocks([row["run_id"]])
        calibrated = loads(blocks[0]["block"])["holding"] if blocks else None
    if calibrated is None or list(calibrated) != list(holding) or not summary.get("blocks"):
        return None
    by_server: dict[Any, list[float]] = {}
    for block in summary["blocks"]:
        for (kept_server, cand_server), b, c in zip(block["starts"], block["base"], block["cand"]):
            by_server.setdefault(("kept", kept_server), []).append(b)
            by_server.setdefault(("cand", cand_server), []).append(c)
    return by_server, f"calibration {calibration} of it in run {row['run_id']}"


def kept_record(store, holding: Sequence[str]) -> tuple[dict, str] | None:
    """Every sample, in this environment, of the servers on which the state's newest plugin was kept (its samples as
    the candidate, and as the kept state's after), by server."""
    from orchestrator.fingerprint import environment, is_stale

    kept = [row for plugin, row in store.deployed().items() if plugin in holding]
    if not holding or len(kept) != len(holding):
        return None
    step = kept[-1]["step_id"]
    current = environment()
    by_server: dict[Any, list[float]] = {}
    for m in store.samples_on_servers_of(step):
        recorded = loads(m["fingerprint"])
        if m["value"] and m["value"] > 0 and recorded and not is_stale(recorded, current):
            by_server.setdefault(m["server"], []).append(m["value"])
    return (by_server, f"its samples where {kept[-1]['plugin']} was kept in step {step}") if by_server else None


def shown(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4g}"


def run_calibration(project, plugins, store, journal, reporter=None, starts: int = 4, pairs: int = 2) -> int:
    """`orchestrator calibrate`: a run of its own that measures the target as it is (its baseline probes once, then
    the A/A blocks) and records the calibration; a signal or a crash leaves nothing changed (no step writes to the
    target). Returns the run's id."""
    from orchestrator.context import open_run
    from orchestrator.deployment import Deployment
    from orchestrator.errors import UserError
    from orchestrator.prober import BaselineFailed
    from orchestrator.recovery import recover
    from orchestrator.stage import Stager

    ctx = open_run(project, store, journal, "calibrate", reporter)
    prober = Prober(ctx, plugins)
    if not prober.throughput:
        store.finish_run(ctx.run_id, "failed", "no throughput probe: nothing to calibrate")
        raise UserError("the project has no throughput probe: there is nothing to calibrate")
    deployment = Deployment(store, journal)
    kept = KeptState.of(list(deployment.rows()))
    try:
        try:
            Stager(ctx, prober, kept, deployment).baseline()
            calibrate(ctx, prober, kept, starts, pairs)
        finally:
            kept.release()
            prober.release()
    except BaseException as e:
        if isinstance(e, BaselineFailed):
            store.finish_run(ctx.run_id, "failed", str(e))
            return ctx.run_id
        recover(store, journal, "interrupted" if isinstance(e, KeyboardInterrupt) else "failed", repr(e), own=True)
        raise
    store.finish_run(ctx.run_id, "finished")
    return ctx.run_id
