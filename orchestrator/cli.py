"""The `orchestrator` command line (typer + rich). Exit codes: 0 done, 2 bad config or manifest, 1 anything else."""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from orchestrator.errors import UserError
from orchestrator.loading import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Applies, measures and rolls back optimizations of an LLM inference deployment.")
plugins_app = typer.Typer(no_args_is_help=True, help="List and validate plugins.")
app.add_typer(plugins_app, name="plugins")
# Piped or logged output (CI, `| tee`) gets wide tables instead of rich's 80-column fallback.
_WIDTH = None if os.environ.get("COLUMNS") else 160
console = Console(width=None if Console().is_terminal else _WIDTH)
err = Console(stderr=True, width=None if Console(stderr=True).is_terminal else _WIDTH)

COMMAND_LINE = "command line"  # where an option's bad value came from, in errors
ConfigOpt = typer.Option(None, "--config", "-c", help="orchestrator.yaml (default: ./orchestrator.yaml, else the "
                                                       "embedded default)")
ArmsOpt = typer.Option(None, "--arms", help="embedded default: how a candidate's samples pair with the kept state's "
                       "(auto, sequential, coresident, simultaneous; target.arms)")
CoresOpt = typer.Option(None, "--server-cores", help="embedded default: the cores of simultaneous arms' servers "
                        "while measured (shared, own; target.server_cores)")


def command(fn: Callable) -> Callable:
    """Map errors to the documented exit codes; the disk or the history failing is a message, not a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import sqlite3
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            err.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        except UserError as e:
            err.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1)
        except sqlite3.DatabaseError as e:
            from orchestrator.store import OPENED, problem
            err.print(f"[red]error:[/] {escape(str(problem(OPENED[-1] if OPENED else Path('orchestrator.db'), e)))}",
                      highlight=False, soft_wrap=True)
            raise typer.Exit(1)
        except OSError as e:
            from orchestrator.failures import describe_os_error
            err.print(f"[red]error:[/] {escape(describe_os_error(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1)
    return wrapper


def _project(config: Optional[Path], engine: Optional[dict] = None):
    from orchestrator.config import load
    return load(config, engine=engine)


def _plugins(project):
    from orchestrator.plugin import load_all
    if not project.plugins_dir.is_dir():
        raise ConfigError(project.source or "<embedded default>", "plugins", f"{project.plugins_dir} is not a folder")
    return load_all(project.plugins_dir, project.target.roots, project.target.vars, project.policy, project.target.kind)


def _open(project, need_roots: bool = True):
    """The store and journal of a writing command; where the roots are is checked before anything is written."""
    from orchestrator.journal import Journal
    from orchestrator.roots import bind, record
    from orchestrator.store import Reader, Store, has_history
    history = Reader(project.db_path) if has_history(project.db_path) else None
    try:
        roots = bind(project, history, need_roots)
    finally:
        if history is not None:
            history.close()
    store = Store(project.db_path)
    record(store, roots)
    return store, Journal(store, project.state_dir, roots)


def _recover(store, journal, force: bool = False, command: bool = False) -> bool:
    """Recover, saying what was ended, put back, left as it is, and what only the intent log knew of; whether there
    was anything to do."""
    from orchestrator.recovery import describe_left, recover
    from orchestrator.store import label
    report = recover(store, journal, force=force)
    for what in report.ended:
        console.print(f"ended {escape(what)}", highlight=False, soft_wrap=True)
    for r in report.steps:
        step = r.step
        if r.unit.unrecorded:
            err.print(f"[yellow]warning:[/] step {step['id']} ({escape(r.unit.name)}) changed "
                      f"{escape(', '.join(r.unit.unrecorded))} but the history had no record of it (a damaged "
                      "database or write-ahead log); restored from the intent log", highlight=False, soft_wrap=True)
        if r.unit.step is not None and r.unit.step["state"] != "done" and command:
            console.print(f"[red]rolled_back[/] {escape(label(step))}: interrupted during {step['state']} "
                          f"(run {step['run_id']})", highlight=False, soft_wrap=True)
        elif r.unit.step is not None and r.unit.step["state"] != "done":
            console.print(f"recovered: [red]{escape(label(step))}[/] rolled back (interrupted during {step['state']}) "
                          f"in run {step['run_id']}", highlight=False, soft_wrap=True)
        if r.plan.left:
            console.print(f"  left as they are: {escape(describe_left(r.plan.left))}", highlight=False,
                          soft_wrap=True)
    for run_id in report.closed:
        console.print(f"run {run_id} recorded as interrupted", highlight=False)
    return bool(report.steps or report.ended or report.closed)


class LiveReporter:
    """Current plugin, phase, probe elapsed time and output tail; one line per finished plugin."""

    def __init__(self, live: Live | None):
        self.live, self.plugin, self.phase_name, self.started = live, "", "", time.monotonic()

    def phase(self, plugin: str, phase: str) -> None:
        self.plugin, self.phase_name, self.started = plugin, phase, time.monotonic()
        self._show(0.0, "")

    def tick(self, elapsed: float, tail: str) -> None:
        self._show(elapsed, tail)

    def _show(self, elapsed: float, tail: str) -> None:
        if self.live is None:
            return
        text = Text.assemble((f"{self.plugin}", "bold"), f"  {self.phase_name}  {elapsed:5.1f}s")
        last = [ln for ln in tail.splitlines() if ln.strip()][-3:]
        if last:
            text.append("\n" + "\n".join("  │ " + ln[:150] for ln in last), style="dim")
        self.live.update(text)

    def outcome(self, plugin: str, outcome: str, reason: str | None, gain: float | None) -> None:
        colour = {"kept": "green", "rolled_back": "red", "skipped": "yellow"}.get(outcome, "cyan")
        extra = "" if gain is None else f"  gain {gain:+.2%}"
        (self.live.console if self.live else console).print(
            f"[{colour}]{outcome:<11}[/] {escape(plugin)}  {escape(reason or '')}{extra}", highlight=False)


def _ids(value: Optional[List[str]]) -> set[str]:
    return {i for v in value or [] for i in v.split(",") if i}


@app.command()
@command
def run(config: Optional[Path] = ConfigOpt,
        only: Optional[List[str]] = typer.Option(None, help="stage only these plugin ids (repeat or comma-separate)"),
        skip: Optional[List[str]] = typer.Option(None, help="do not stage these plugin ids"),
        preset: Optional[str] = typer.Option(None, help="embedded default: the engine's model preset "
                                             "(tiny, tiny-hybrid, small, qwen3.6-35b-a3b, "
                                             "qwen3.6-35b-a3b-dense) or a config.json"),
        device: Optional[str] = typer.Option(None, help="embedded default: the engine's device (cpu, cuda, cuda:N)"),
        dtype: Optional[str] = typer.Option(None, help="embedded default: float32, float16 or bfloat16"),
        num_layers: Optional[int] = typer.Option(None, help="embedded default: the model's depth"),
        arms: Optional[str] = ArmsOpt,
        server_cores: Optional[str] = CoresOpt,
        attribute: bool = typer.Option(False, "--attribute", help="after the final re-validation, measure each "
                                       "kept plugin's contribution (the stack without it against the whole stack)"),
        reverify: bool = typer.Option(False, "--reverify", help="stage nothing; re-judge the kept plugins whose "
                                      "decisions were measured in another environment (shown stale by status)"),
        workers: Optional[int] = typer.Option(None, "--workers", min=1, max=100, help="screen independent "
                                              "candidates on this many workers at once, each with a GPU of its own "
                                              "where the target runs on GPUs (default: policy.workers, 1); needs "
                                              "Ray (.[ray])"),
        ray_address: Optional[str] = typer.Option(None, "--ray-address", help="the Ray cluster of the workers "
                                                  "(HOST:PORT of its head node; default: a local cluster started "
                                                  "for the run, as `local` does)")) -> None:
    """Measure the baseline, then stage every plugin in order: keep what helps, roll back the rest."""
    from orchestrator.lock import project_lock
    from orchestrator.loop import Interrupted, run as stage_all
    from orchestrator.status import status_data
    project = _project(config, {"model": preset, "device": device, "dtype": dtype, "num_layers": num_layers,
                                "arms": arms, "server_cores": server_cores})
    plugins = _plugins(project)
    only_ids, skip_ids = _ids(only), _ids(skip)
    if reverify and (attribute or only_ids or skip_ids or workers or ray_address):
        raise UserError("--reverify re-judges the kept plugins only; it takes no --attribute, --only, --skip, "
                        "--workers or --ray-address")
    unknown = (only_ids | skip_ids) - {p.id for p in plugins}
    if unknown:
        raise ConfigError(project.plugins_dir, "--only/--skip", f"unknown plugin id(s): {', '.join(sorted(unknown))}")
    project.target.check()
    if workers is not None:
        project.policy = project.policy.model_copy(update={"workers": workers})
    # before anything is written: a policy, an installation or a cluster that cannot give the workers changes nothing
    pool = None if reverify else _pool(project, "--workers" if workers is not None else "policy.workers", ray_address)
    try:
        with project_lock(project):
            store, journal = _open(project)
            _recover(store, journal)
            shutil.rmtree(project.state_dir / "tmp", ignore_errors=True)  # output files of processes a crash left
            project.target.prepare()

            def stop(signum, frame):
                raise Interrupted(f"signal {signum}")
            signal.signal(signal.SIGTERM, stop)
            live = Live(console=console, transient=True, refresh_per_second=8) if console.is_terminal else None
            stage = functools.partial(stage_all, project, plugins, store, journal, LiveReporter(live), only_ids,
                                      skip_ids, attribute, reverify, pool)
            try:
                if live:
                    with live:
                        run_id = stage()
                else:
                    run_id = stage()
            except (KeyboardInterrupt, Interrupted):
                raise UserError("interrupted; the unfinished plugin was rolled back and the run recorded as "
                                "interrupted")
            data = status_data(store, run_id)
            show_status(data)
            if data["run"]["status"] != "finished":
                raise UserError(f"run {run_id} {data['run']['status']}: {data['run']['detail']}")
    finally:
        if pool is not None:
            pool.close()


def _pool(project, field: str, address: Optional[str]):
    """The run's screening workers on Ray (workers.py), or None: with one worker and no cluster named, Ray is not
    even imported. ConfigError naming the option or field (`field`: where the number of workers came from) where
    the policy, the installation or the cluster cannot give them."""
    policy, config = project.policy, project.source or "<embedded default>"
    where = COMMAND_LINE if field.startswith("--") else config
    if policy.duet and policy.workers < 2:
        raise ConfigError(config, "policy.duet", f"a duet measures each candidate on two workers; {field} is "
                          f"{policy.workers}")
    if policy.duet and not policy.interleave:
        raise ConfigError(config, "policy.duet", "a duet takes pairs of samples: it needs interleave: true")
    if policy.workers == 1 and address is None:
        return None
    try:
        from orchestrator import workers
    except ImportError as e:
        raise ConfigError(where, field, f"{policy.workers} workers run on Ray, which cannot be imported here ({e}): "
                          "install it with `pip install 'llm-deploy-orchestrator[ray]'`") from None
    try:
        return workers.connect(policy.workers, project.target.uses_gpu(), address, policy.duet)
    except workers.Refused as e:
        raise ConfigError(COMMAND_LINE if e.address else where, "--ray-address" if e.address else field,
                          str(e)) from None


@app.command()
@command
def calibrate(config: Optional[Path] = ConfigOpt,
              starts: int = typer.Option(4, min=3, max=50, help="fresh candidate servers of the state, each an A/A "
                                         "block"),
              pairs: int = typer.Option(2, min=2, max=20, help="pairs each block takes against the kept state"),
              preset: Optional[str] = typer.Option(None, help="embedded default: the engine's model preset"),
              device: Optional[str] = typer.Option(None, help="embedded default: the engine's device"),
              dtype: Optional[str] = typer.Option(None, help="embedded default: float32, float16 or bfloat16"),
              num_layers: Optional[int] = typer.Option(None, help="embedded default: the model's depth"),
              arms: Optional[str] = ArmsOpt,
              server_cores: Optional[str] = CoresOpt) -> None:
    """An A/A test of the target as it is: the spread of the objective within a server's life and between starts,
    the false-keep rate and the pairs needed at the policy's bar. Later runs judge by it."""
    from orchestrator.calibrate import run_calibration
    from orchestrator.lock import project_lock
    from orchestrator.loop import Interrupted
    from orchestrator.status import calibration_lines, status_data
    project = _project(config, {"model": preset, "device": device, "dtype": dtype, "num_layers": num_layers,
                                "arms": arms, "server_cores": server_cores})
    plugins = _plugins(project)
    project.target.check()
    with project_lock(project):
        store, journal = _open(project)
        _recover(store, journal)
        shutil.rmtree(project.state_dir / "tmp", ignore_errors=True)
        project.target.prepare()

        def stop(signum, frame):
            raise Interrupted(f"signal {signum}")
        signal.signal(signal.SIGTERM, stop)
        try:
            run_id = run_calibration(project, plugins, store, journal, LiveReporter(None), starts, pairs)
        except (KeyboardInterrupt, Interrupted):
            raise UserError("interrupted; the calibration was recorded as interrupted")
        data = status_data(store, run_id)
        for line in calibration_lines(data):
            console.print(line, highlight=False, soft_wrap=True)
        if data["run"]["status"] != "finished":
            raise UserError(f"run {run_id} {data['run']['status']}: {data['run']['detail']}")


@app.command()
@command
def status(config: Optional[Path] = ConfigOpt,
           json_out: bool = typer.Option(False, "--json", help="machine-readable, as documented"),
           run_id: Optional[int] = typer.Option(None, "--run", help="a run id (default: the latest run)"),
           runs: bool = typer.Option(False, "--runs", help="list all runs")) -> None:
    """Outcomes of the latest run (works while a run is going)."""
    from orchestrator.status import runs_table, status_data
    from orchestrator.store import Reader, has_history
    project = _project(config)
    store = Reader(project.db_path) if project.db_path.exists() else None
    if store is None or not has_history(project.db_path) or store.empty():
        raise UserError(f"no runs recorded yet in {project.state_dir}")
    if runs:
        if json_out:
            from orchestrator.status import shown
            print(json.dumps([shown(store, r) for r in store.runs()], indent=1, default=str))
        else:
            console.print(runs_table(store))
        return
    data = status_data(store, run_id)
    if data is None:
        raise UserError(f"no run {run_id}" if run_id is not None else "no runs recorded yet")
    if json_out:
        print(json.dumps(data, indent=1, default=str))
    else:
        show_status(data)


BASELINE_SHOWN = ("score", "cpu_score", "output_throughput", "duration", "mean_ttft_ms", "mean_tpot_ms")


def show_status(data: dict) -> None:
    from orchestrator.status import calibration_lines, revalidation_lines, screening_line, steps_table
    if data["baseline"]:
        shown = {k: v for k, v in data["baseline"].items() if k in BASELINE_SHOWN} or data["baseline"]
        console.print("baseline: " + ", ".join(f"{k}={v:.4g}" for k, v in shown.items()), highlight=False,
                      soft_wrap=True)
    for line in calibration_lines(data):
        console.print(line, highlight=False, soft_wrap=True)
    if data["steps"] or data["run"]["command"] != "calibrate":
        console.print(steps_table(data))
    for line in revalidation_lines(data):
        console.print(line, highlight=False, soft_wrap=True)
    if line := screening_line(data):
        console.print(line, highlight=False, soft_wrap=True)


@app.command()
@command
def plan(config: Optional[Path] = ConfigOpt) -> None:
    """The ordered plan, preconditions and the diff each plugin would make. Changes nothing."""
    from orchestrator.plan import build_plan
    from orchestrator.store import Reader, has_history
    project = _project(config)
    plugins = _plugins(project)
    kept: set[str] = set()
    if has_history(project.db_path):
        store = Reader(project.db_path)
        kept = set() if store.empty() else set(store.deployed())
    for root in dict.fromkeys(project.target.roots.values()):
        if not root.exists():
            console.print(f"[yellow]{escape(str(root))} does not exist yet: the first `orchestrator run` creates it; "
                          "steps on its files are shown failing until then[/]", highlight=False, soft_wrap=True)
    for i, item in enumerate(build_plan(project, plugins, kept), 1):
        m = item.plugin.manifest
        head = f"[bold]{i}. {escape(m.id)}[/] (order {m.order})" + (f" – {escape(m.description)}" if m.description else "")
        console.print(head, highlight=False, soft_wrap=True)
        if m.id in kept:
            console.print("   kept earlier: staged again only if its files changed since", highlight=False)
        for note in item.notes:
            console.print(f"   {escape(note)}", highlight=False, soft_wrap=True)
        if item.skipped:
            console.print(f"   [yellow]would be skipped: {escape(item.skipped)}[/]", highlight=False)
        for diff in item.diffs:
            console.print(Text(diff.rstrip("\n")), highlight=False, soft_wrap=True)


@app.command()
@command
def rollback(plugin_ids: Optional[List[str]] = typer.Argument(None, help="kept plugins to roll back"),
             all_: bool = typer.Option(False, "--all", help="every kept plugin, newest first"),
             force: bool = typer.Option(False, "--force", help="overwrite files changed since they were kept (and, "
                                        "in the recovery first, since an interrupted command stopped)"),
             config: Optional[Path] = ConfigOpt) -> None:
    """Undo kept plugins in reverse order, byte for byte."""
    from orchestrator.lock import project_lock
    from orchestrator.rollback import plan_rollback, roll_back
    project = _project(config)
    if not all_ and not plugin_ids:
        raise UserError("name the plugins to roll back, or pass --all")
    plugins = {p.id: p for p in _plugins(project)}
    with project_lock(project):
        store, journal = _open(project)
        _recover(store, journal, force)
        todo = plan_rollback(store, journal, None if all_ else _ids(plugin_ids), force, plugins)
        if todo:
            for row in roll_back(store, journal, project, todo, plugins):
                console.print(f"[red]rolled_back[/] {escape(row['plugin'])}", highlight=False)
        else:
            console.print("nothing to roll back")
        if all_:
            _collected(journal)


def _collected(journal) -> None:
    removed, freed = journal.collect()
    if removed:
        console.print(f"removed {removed} blob(s) no longer needed ({freed / 1e6:.1f} MB)", highlight=False)


@app.command()
@command
def gc(config: Optional[Path] = ConfigOpt) -> None:
    """Delete the blobs (pre- and post-images) no kept plugin or unfinished step needs."""
    from orchestrator.lock import project_lock
    from orchestrator.store import has_history
    project = _project(config)
    if not has_history(project.db_path):
        console.print("nothing to collect")
        return
    with project_lock(project, need_roots=False):
        store, journal = _open(project, need_roots=False)
        _recover(store, journal)  # an unfinished step's images are needed until it is recovered
        removed, freed = journal.collect()
        console.print(f"removed {removed} blob(s) no longer needed ({freed / 1e6:.1f} MB); "
                      f"{sum(1 for _ in journal.blobs.iterdir())} kept", highlight=False)


@app.command()
@command
def recover(config: Optional[Path] = ConfigOpt,
            force: bool = typer.Option(False, "--force", help="also overwrite recorded paths changed after the run "
                                       "stopped, and leave those whose pre-image is missing or damaged as they are")
            ) -> None:
    """Restore the last kept state after a crash (also done at the start of run and rollback)."""
    from orchestrator.lock import project_lock
    from orchestrator.store import Reader, has_history
    project = _project(config)
    if not has_history(project.db_path):
        if project.db_path.exists():
            Reader(project.db_path)  # a zero-length database beside recorded images is a lost history: say so
        console.print("nothing to recover")
        return
    with project_lock(project, need_roots=False):
        store, journal = _open(project, need_roots=False)
        if not _recover(store, journal, force, command=True):
            console.print("nothing to recover")


@plugins_app.command("list")
@command
def plugins_list(config: Optional[Path] = ConfigOpt) -> None:
    """Plugins in staging order."""
    from rich.table import Table
    project = _project(config)
    table = Table(title=str(project.plugins_dir))
    table.add_column("order")
    table.add_column("id", no_wrap=True)
    table.add_column("description", overflow="ellipsis", no_wrap=True, max_width=60)
    for col in ("requires", "after", "targets", "params"):
        table.add_column(col)
    for p in _plugins(project):
        m = p.manifest
        table.add_row(str(m.order), m.id, escape(m.description), ", ".join(m.requires), ", ".join(m.after),
                      ", ".join(m.targets), str(len(p.variants)) if m.params else "")
    console.print(table)


@plugins_app.command("validate")
@command
def plugins_validate(path: Optional[Path] = typer.Argument(None, help="a plugin folder, its plugin.yaml, or a "
                                                                      "folder of plugins (default: the config's)"),
                     config: Optional[Path] = ConfigOpt) -> None:
    """Validate manifests against the schema and the target; exit 2 on the first error."""
    from orchestrator.plugin import MANIFEST, load_all, load_plugin
    project = _project(config)
    roots, variables = project.target.roots, project.target.vars
    path = path or project.plugins_dir
    if path.is_file():
        path = path.parent
    if (path / MANIFEST).is_file():
        plugins = [load_plugin(path, roots, variables, project.target.kind)]
    elif path.is_dir():
        plugins = load_all(path, roots, variables, project.policy, project.target.kind)
    else:
        raise ConfigError(path, None, "no such plugin folder")
    console.print(f"ok: {len(plugins)} plugin(s) valid: {', '.join(p.id for p in plugins)}", highlight=False,
                  soft_wrap=True)


@app.command()
@command
def schema() -> None:
    """JSON Schema of plugin.yaml, for editors."""
    from orchestrator.plugin import schema as manifest_schema
    print(json.dumps(manifest_schema(), indent=1))


@app.command()
@command
def new(plugin_id: str = typer.Argument(..., help="the new plugin's id"),
        directory: Optional[Path] = typer.Option(None, "--dir", help="folder of plugins (default: the config's)"),
        config: Optional[Path] = ConfigOpt) -> None:
    """Scaffold a plugin folder with a commented plugin.yaml."""
    from pydantic import TypeAdapter, ValidationError

    from orchestrator.plugin import PluginId
    from orchestrator.scaffold import scaffold
    try:
        TypeAdapter(PluginId).validate_python(plugin_id)
    except ValidationError as e:
        raise ConfigError(None, "ID", f"{plugin_id!r} is not a valid plugin id (letters, digits, . _ -): "
                          f"{e.errors(include_url=False)[0]['msg']}") from None
    directory = directory or _project(config).plugins_dir
    try:
        folder = scaffold(directory, plugin_id)
    except FileExistsError as e:
        raise UserError(str(e))
    console.print(f"created {escape(str(folder / 'plugin.yaml'))}", highlight=False)


@app.command()
@command
def report(config: Optional[Path] = ConfigOpt,
           run_id: Optional[int] = typer.Option(None, "--run", help="a run id (default: the latest run)"),
           out: Optional[Path] = typer.Option(None, "--out", help="output folder (default: state/reports/run-N)")) -> None:
    """Write a report of a run (tables and plots)."""
    try:
        from orchestrator.report import write_report
    except ImportError as e:
        raise UserError(f"reports are not available in this installation (orchestrator.report: {e})")
    from orchestrator.store import Reader, has_history
    project = _project(config)
    store = Reader(project.db_path) if project.db_path.exists() else None
    if store is None or not has_history(project.db_path) or store.empty():
        raise UserError(f"no runs recorded yet in {project.state_dir}")
    run_row = store.run(run_id) if run_id is not None else store.run() or store.run(command=None)  # a calibration
    if run_row is None:
        raise UserError(f"no run {run_id}" if run_id is not None else "no runs recorded yet")
    store.close()
    out = out or project.state_dir / "reports" / f"run-{run_row['id']}"
    console.print(f"wrote {escape(str(write_report(project.db_path, run_row['id'], out)))}", highlight=False)


if __name__ == "__main__":
    sys.exit(app())
