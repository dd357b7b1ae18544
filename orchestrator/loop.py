"""`orchestrator run`: the baseline, each plugin staged in order against the last kept state, then the stack the
run kept re-measured. However the run ends it is recorded, and a signal or a crash first restores the last kept
state."""
from __future__ import annotations

from orchestrator.config import Project
from orchestrator.context import Reporter, open_run
from orchestrator.deployment import Deployment
from orchestrator.journal import Journal
from orchestrator.measure import BaselineFailed, Measurer
from orchestrator.plugin import Plugin
from orchestrator.recovery import recover
from orchestrator.restack import Restack
from orchestrator.stage import Stager
from orchestrator.store import Store


class Interrupted(Exception):
    """Raised from a signal handler (SIGTERM) so the loop restores the target before exiting."""


def run(project: Project, plugins: list[Plugin], store: Store, journal: Journal, reporter: Reporter | None = None,
        only: set[str] | None = None, skip: set[str] | None = None, attribute: bool = False,
        reverify: bool = False) -> int:
    """Stage the plugins, then re-validate the stack this run kept (and, with `attribute`, each plugin's share);
    `reverify` instead re-judges the kept plugins whose decisions were measured in another environment.
    Returns the run's id."""
    ctx = open_run(project, store, journal, "run", reporter)
    measurer = Measurer(ctx)
    deployment = Deployment(store, journal)
    restack = Restack(ctx, measurer, deployment, plugins)
    try:
        if reverify:
            restack.reverify()
        else:
            measurer.baseline()
            stager = Stager(ctx, measurer, deployment)
            for plugin in plugins:
                if (only and plugin.id not in only) or (skip and plugin.id in skip):
                    continue
                stager.stage(plugin)
            kept = deployment.kept_by(ctx.run_id)
            if measurer.throughput and kept:
                restack.revalidate(kept)
                if attribute:
                    restack.attribute(kept)
    except (KeyboardInterrupt, Interrupted):
        recover(store, journal, "interrupted", "stopped by a signal")
        raise
    except BaselineFailed as e:
        store.finish_run(ctx.run_id, "failed", str(e))
        return ctx.run_id
    except Exception as e:
        recover(store, journal, "failed", f"internal error: {e!r}")
        raise
    store.finish_run(ctx.run_id, "finished")
    return ctx.run_id
