"""`orchestrator run`: the baseline (and, where the policy asks and none is recorded here, an A/A calibration of
it, or of the first state the run keeps), each plugin staged in order against the last kept state, then the stack
the run kept re-measured. However the run ends it is recorded, and a signal or a crash first restores the last kept
state. A run cut short (an environment failure, a signal, the loss of its process or machine) is continued by the
next one."""
from __future__ import annotations

import gc

from orchestrator.calibrate import calibrate, latest, moved
from orchestrator.config import Project
from orchestrator.context import Reporter, RunContext, open_run
from orchestrator.deployment import Deployment
from orchestrator.errors import UserError
from orchestrator.failures import describe, is_environment
from orchestrator.journal import Journal
from orchestrator.kept import KeptState
from orchestrator.noise import Noise, wakes_like_fresh
from orchestrator.plugin import Plugin
from orchestrator.prober import BaselineFailed, EnvironmentFailed, Prober
from orchestrator.recovery import recover
from orchestrator.restack import Restack
from orchestrator.screening import Screening
from orchestrator.stage import Stager
from orchestrator.store import Store


CUT_SHORT = ("environment_failed", "interrupted")  # reasons that decide nothing about the plugin


class Interrupted(BaseException):
    """Raised from a signal handler (SIGTERM) so the loop restores the target before exiting; like
    KeyboardInterrupt, no handler of errors catches it on the way."""


def run(project: Project, plugins: list[Plugin], store: Store, journal: Journal, reporter: Reporter | None = None,
        only: set[str] | None = None, skip: set[str] | None = None, attribute: bool = False,
        reverify: bool = False, pool=None) -> int:
    """Stage the plugins, then re-validate the stack this run kept (and, with `attribute`, each plugin's share);
    `reverify` instead re-judges the kept plugins whose decisions were measured in another environment. With a
    `pool` of workers (workers.py), independent candidates are screened on them first (screening.py).
    Returns the run's id."""
    # Everything imported and loaded so far lives as long as the run: frozen, the collector's full passes skip it
    # and stay short (unfrozen, one took 0.2 s on a busy 2-core machine), so no pause falls between starting a
    # process and recording it for recovery.
    gc.freeze()
    ctx = open_run(project, store, journal, "run", reporter)
    prober = Prober(ctx, plugins)
    deployment = Deployment(store, journal)
    kept = KeptState.of(list(deployment.rows()))
    noise = sleep_or_restart(ctx, prober.objective, latest(store, prober.objective, ctx.pairing)) \
        if prober.throughput else None
    stager = Stager(ctx, prober, kept, deployment, noise)
    restack = Restack(ctx, prober, kept, deployment, plugins, lambda: stager.noise)
    screening = Screening(stager, pool, plugins) if pool is not None else None
    try:
        try:
            if reverify:
                restack.reverify()
            else:
                chain = continued(store, ctx.run_id)
                carry = chain  # the runs whose unfinished A/A blocks a calibration here counts
                earlier = {} if only else decided(store, chain)
                chosen = [p for p in plugins if not ((only and p.id not in only) or (skip and p.id in skip))]
                stager.settle(plugins, {p.id for p in chosen if p.id not in earlier})
                stager.baseline()
                if noise is not None and (why := moved(store, noise, kept.arm.holding,
                                                       [s.value for s in kept.samples or []])):
                    store.event(ctx.run_id, "warning", why)
                    stager.noise = noise = None  # calibrated anew as though none were recorded, its blocks included
                    carry = []
                calibration = project.policy.calibrate if noise is None and prober.throughput else None
                if calibration and (calibration.at == "start" or screening is not None):
                    stager.noise = calibrated(ctx, prober, kept, carry)
                if screening is not None:
                    screening.stage(chosen, earlier)
                else:
                    for plugin in chosen:
                        if plugin.id in earlier:
                            stager.decided_earlier(plugin, earlier[plugin.id])
                            continue
                        if stager.noise is None and calibration and deployment.kept_by([*chain, ctx.run_id]):
                            stager.noise = calibrated(ctx, prober, kept, carry)  # of the first kept state
                        stager.stage(plugin)
                kept_steps = deployment.kept_by([*chain, ctx.run_id])
                if prober.throughput and kept_steps:
                    restack.revalidate(kept_steps)
                    if attribute:
                        restack.attribute(kept_steps)
        finally:
            kept.release()  # however the run ends, its live servers are stopped first (recovery only kills)
            prober.release()
    except (KeyboardInterrupt, Interrupted):
        recover(store, journal, "interrupted", "stopped by a signal", own=True)
        raise
    except (BaselineFailed, EnvironmentFailed) as e:
        store.finish_run(ctx.run_id, "failed", str(e))
        return ctx.run_id
    except Exception as e:
        if not (is_environment(e) or isinstance(e, UserError)):
            recover(store, journal, "failed", f"internal error: {e!r}", own=True)
            raise
        stopped(store, journal, ctx.run_id, e)  # raises
    store.finish_run(ctx.run_id, "finished")
    journal.settle()
    return ctx.run_id


def calibrated(ctx: RunContext, prober: Prober, kept: KeptState, carry: list[int]) -> Noise:
    """An A/A calibration of the kept state in the run's pairing, continuing one the runs in `carry` (those this one
    continues) left unfinished; where it finds that woken servers do not measure like fresh ones, the run restarts
    servers instead, judged by a calibration of that (taken now if none is)."""
    policy = ctx.project.policy
    noise = calibrate(ctx, prober, kept, policy.calibrate.starts, policy.calibrate.pairs, carry)
    restart = sleep_or_restart(ctx, prober.objective, noise)
    if restart is noise:
        return noise
    kept.release()  # the sleeping pairing's server: the kept state's is started anew where it is needed
    return restart or calibrate(ctx, prober, kept, policy.calibrate.starts, policy.calibrate.pairs, carry)


def sleep_or_restart(ctx: RunContext, objective: str | None, noise: Noise | None) -> Noise | None:
    """The noise to judge by. A calibration of the sleeping pairing in which a wake moved a server more than
    `wakes_like_fresh` allows turns the run to restarting servers: it says so, and the noise is then the newest
    calibration of that pairing here, if any."""
    if ctx.pairing != "sleeping" or noise is None or wakes_like_fresh(noise):
        return noise
    ctx.store.event(ctx.run_id, "warning", f"woken servers do not measure like the servers they were: a wake moved "
                    f"log({objective}) by {noise.wake:.2%} (RMS) against {noise.within:.2%} within a server's life "
                    f"and {noise.between:.2%} between starts (calibration {noise.calibration}); servers are "
                    "restarted at each switch of arm instead")
    ctx.pairing = "sequential"
    ctx.sleepers.clear()
    return latest(ctx.store, objective, ctx.pairing)


def stopped(store: Store, journal: Journal, run_id: int, error: Exception) -> None:
    """The disk or the history failed under the run (a full disk, a damaged database): put back what it can and
    end the run `failed`, saying why and what to do; if even that fails, the next `recover` does it."""
    why = describe(error, recovered=True)
    try:
        recover(store, journal, "failed", why, own=True)
        store.finish_run(run_id, "failed", why)
    except Exception as again:  # noqa: BLE001 - the first failure is the one to report
        why = (f"{describe(error)}; putting the target back failed too ({describe(again)}): when that is fixed, "
               "`orchestrator recover` puts back what the run left")
        try:
            store.finish_run(run_id, "failed", why)
        except Exception:  # noqa: BLE001 - status tells a dead run from a running one by its process
            pass
    raise UserError(why)


def continued(store: Store, run_id: int) -> list[int]:
    """The runs a new run continues, oldest first: those just before it that were cut short. Together they are one
    run: what they kept is re-validated with it, what they rolled back is not staged again."""
    chain = []
    for earlier in store.runs_before(run_id, "run"):
        if not cut_short(store, earlier):
            break
        chain.append(earlier["id"])
    return chain[::-1]


def cut_short(store: Store, run: dict) -> bool:
    """Stopped before deciding every plugin, for no reason of the plugins': an environment failure, a signal, or the
    loss of its process (killed, its machine gone: the next command's recovery records it interrupted)."""
    if run["status"] == "interrupted":
        return True
    return run["status"] == "failed" and any(s["reason"] == "environment_failed" for s in store.steps(run["id"]))


def decided(store: Store, chain: list[int]) -> dict[str, list[dict]]:
    """Plugins the continued runs rolled back for reasons of their own: {plugin id: its steps in the newest run
    that decided it}. Kept plugins need no carrying (they are found already applied); a plugin whose newest
    attempt was cut short (environment_failed, interrupted) is staged again."""
    out: dict[str, list[dict]] = {}
    for run_id in chain:
        attempts: dict[str, list[dict]] = {}
        for s in store.steps(run_id):
            if s["kind"] in ("attempt", "screening") and s["outcome"] in ("kept", "rolled_back"):
                attempts.setdefault(s["plugin"], []).append(s)
        for plugin_id, steps in attempts.items():
            if all(s["outcome"] == "rolled_back" and s["reason"] not in CUT_SHORT for s in steps):
                out[plugin_id] = steps
            else:
                out.pop(plugin_id, None)
    return out

