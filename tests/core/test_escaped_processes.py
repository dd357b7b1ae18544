"""No process a probe or a step starts outlives it, not even a double-forked one in a session of its own,
and `recover` finds what a killed run left even where no row recorded it."""
from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from core_project import make_project, tree
from orchestrator.probes.marks import MARK
from orchestrator.probes.runner import judge_output, run_process

# Forks, the child calls setsid and forks again, the middle one exits: the grandchild is in no group or
# tree of ours. It writes its pid to the file named by argv[1] (or $PIDFILE), then sleeps.
DAEMON = textwrap.dedent("""\
    import os, sys, time
    from pathlib import Path
    pidfile = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ["PIDFILE"])
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            pidfile.with_suffix(".tmp").write_text(str(os.getpid()))
            pidfile.with_suffix(".tmp").rename(pidfile)
            time.sleep(300)
        os._exit(0)
    os.waitpid(child, 0)
    while not pidfile.exists():
        time.sleep(0.01)
    """)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone_within(pid: int, seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def wait_for(path: Path, seconds: float = 60) -> int:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return int(path.read_text())


@pytest.fixture
def daemon(tmp_path):
    script = tmp_path / "daemon.py"
    script.write_text(DAEMON)
    pids: list[int] = []
    yield script, pids
    for pid in pids:  # whatever a failing test left
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_double_forked_grandchild_of_a_probe_dies_when_the_probe_ends(tmp_path, daemon):
    script, pids = daemon
    probe = tmp_path / "probe.py"
    probe.write_text(f"import json, runpy, sys\nsys.argv = ['d', {str(tmp_path / 'pid')!r}]\n"
                     f"runpy.run_path({str(script)!r})\nprint(json.dumps({{'passed': True}}))\n")
    result = run_process([sys.executable, str(probe)], tmp_path, dict(os.environ), 60)
    pids.append(int((tmp_path / "pid").read_text()))
    assert judge_output("correctness", None, result, 60).ok
    assert gone_within(pids[0], 0.5)  # gone by the time run_process returned (allowing for the reaper)


def test_a_double_forked_grandchild_dies_when_its_probe_times_out(tmp_path, daemon):
    script, pids = daemon
    probe = tmp_path / "probe.py"
    probe.write_text(f"import runpy, sys, time\nsys.argv = ['d', {str(tmp_path / 'pid')!r}]\n"
                     f"runpy.run_path({str(script)!r})\ntime.sleep(300)\n")
    result = run_process([sys.executable, str(probe)], tmp_path, dict(os.environ), 3)
    pids.append(int((tmp_path / "pid").read_text()))
    assert result.timed_out
    assert gone_within(pids[0], 0.5)


def test_processes_carry_the_mark_and_a_mark_they_inherited(tmp_path):
    show = [sys.executable, "-c", f"import os, json; print(json.dumps({{'m': os.environ[{MARK!r}]}}))"]
    outer = run_process(show, tmp_path, dict(os.environ), 30).result["m"]
    assert len(outer.split()) == 1
    inner = run_process(show, tmp_path, {**os.environ, MARK: "outer.1"}, 30).result["m"]
    assert inner.split()[0] == "outer.1" and len(inner.split()) == 2


def test_a_daemon_started_by_a_command_step_does_not_outlive_the_run(tmp_path, daemon):
    script, pids = daemon
    project = make_project(tmp_path, plugins=["speedup"])
    plugin = project.path / "plugins" / "forks"
    plugin.mkdir()
    (plugin / "plugin.yaml").write_text(
        "id: forks\norder: 5\napply:\n"
        f"  - command: {{run: [python, {str(script)!r}, {str(tmp_path / 'step.pid')!r}], timeout: 60}}\n")
    project.cli("run", check=0)
    pids.append(int((tmp_path / "step.pid").read_text()))
    assert not alive(pids[0])


def test_recover_kills_what_a_killed_run_left_even_without_a_recorded_row(tmp_path, daemon):
    """The run is killed while its probe runs; the probe's row is then removed, as if the kill had come between
    the start of the probe and its row: only the mark in their environment finds the probe and its daemon."""
    script, pids = daemon
    project = make_project(tmp_path, plugins=["speedup"])
    (project.path / "probes" / "correct.py").write_text(
        f"import os, runpy, sys, time\nfrom pathlib import Path\n"
        f"if os.environ['ORCHESTRATOR_PLUGIN'] == 'speedup':\n"
        f"    sys.argv = ['d', {str(tmp_path / 'probe-daemon.pid')!r}]\n"
        f"    runpy.run_path({str(script)!r})\n"
        f"    Path({str(tmp_path / 'probe.pid')!r}).write_text(str(os.getpid()))\n"
        f"    time.sleep(300)\n"
        f"print('{{\"passed\": true}}')\n")
    before = tree(project.target)
    run = project.spawn("run")
    try:
        probe_pid = wait_for(tmp_path / "probe.pid")
        pids += [probe_pid, int((tmp_path / "probe-daemon.pid").read_text())]
    finally:
        run.kill()
        run.wait()
    assert all(alive(pid) for pid in pids)  # a SIGKILLed orchestrator cleans nothing up
    with project.db() as db:
        assert db.execute("DELETE FROM processes").rowcount >= 1
    out = project.cli("recover", check=0)
    assert "speedup" in out.stdout
    assert all(gone_within(pid) for pid in pids)
    assert tree(project.target) == before


def test_recover_spares_processes_of_another_state_folder(tmp_path, daemon):
    script, pids = daemon
    other = tmp_path / "other"
    other.mkdir()
    project = make_project(tmp_path / "p", plugins=["speedup"])
    project.cli("run", check=0)
    from orchestrator.probes.marks import scope_of
    env = {**os.environ, MARK: scope_of(other / "state") + ".1"}
    psutil.Popen([sys.executable, str(script), str(tmp_path / "other.pid")], env=env).wait()
    pids.append(wait_for(tmp_path / "other.pid"))
    project.cli("recover", check=0)
    assert alive(pids[0])
