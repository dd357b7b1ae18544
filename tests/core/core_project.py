"""A throw-away project (files target, test probes, chosen test plugins) and ways to run the real CLI on it."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import yaml

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]
MAIN_PLUGINS = sorted(p.name for p in (FIXTURES / "plugins").iterdir())


def tree(root: Path) -> dict[str, bytes]:
    """Every file (and folder, as None) under root: equality means byte-for-byte identical."""
    out: dict[str, bytes | None] = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = p.read_bytes() if p.is_file() else None
    return out


def images(root: Path) -> dict[str, tuple]:
    """Everything under root as it is: files (bytes, mode), symlinks (target text), folders (mode)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", st.st_mode & 0o7777)
            else:
                out[rel] = ("file", p.read_bytes(), st.st_mode & 0o7777)
    return out


def state_images(root: Path) -> dict[str, tuple]:
    """{relative path: (image, permission bits)} of everything under root, images as the history writes them:
    a file's sha256, "symlink:" and the target text, "dir"."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("symlink:" + os.readlink(p), None)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", st.st_mode & 0o7777)
            else:
                out[rel] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mode & 0o7777)
    return out


def expected_images(original: dict[str, tuple], db_path: Path) -> dict[str, tuple]:
    """What a files target holds when exactly the plugins the history calls kept are applied, in their order,
    to `original` (state_images of the untouched target). A mode the history did not record is None."""
    import sqlite3
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    columns = [r[1] for r in conn.execute("PRAGMA table_info(files)")]
    kind = "f.kind" if "kind" in columns else "NULL"
    out = dict(original)
    for path, after, mode, what in conn.execute(
            f"SELECT f.path, f.after, f.after_mode, {kind} FROM deployed d JOIN files f ON f.step_id = d.step_id "
            "ORDER BY d.kept_at, d.step_id, f.id"):
        if what == "dir":
            out[path] = ("dir", None)
        elif after is None:
            out.pop(path, None)
        else:
            out[path] = (after, None if mode is None else mode & 0o7777)
    conn.close()
    return out


def assert_consistent(root: Path, expected: dict[str, tuple]) -> None:
    """The target holds exactly `expected` (a mode of None matches any)."""
    now = state_images(root)
    assert set(now) == set(expected), (sorted(set(now) - set(expected)), sorted(set(expected) - set(now)))
    for rel, (image, mode) in expected.items():
        assert now[rel][0] == image and (mode is None or now[rel][1] == mode), (rel, now[rel], (image, mode))


def ended(project: "Project", timeout: float) -> bool:
    """Whether every process the project's commands started (each carries its state folder's mark) has ended, waiting
    up to `timeout` seconds."""
    from orchestrator.probes.marks import marked, scope_of
    prefix = scope_of(project.state) + "."
    deadline = time.monotonic() + timeout
    while marked(lambda marks: any(m.startswith(prefix) for m in marks)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def set_probes(project: "Project", probes: list[dict]) -> None:
    config = yaml.safe_load(project.config.read_text())
    config["probes"] = probes
    project.config.write_text(yaml.safe_dump(config, sort_keys=False))


def add_plugin(project: "Project", manifest: dict) -> None:
    folder = project.path / "plugins" / manifest["id"]
    folder.mkdir(parents=True)
    (folder / "plugin.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))


class Project:
    def __init__(self, path: Path):
        self.path = path
        self.config = path / "orchestrator.yaml"
        self.target = path / "target"
        self.state = path / "state"

    def cli(self, *args: str, timeout: float = 120, env: dict | None = None, check: int | None = None):
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "TEST_MARKER_DIR": str(self.path),
                    **(env or {})}
        proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "--config", str(self.config)],
                              cwd=self.path, env=full_env, capture_output=True, text=True, timeout=timeout)
        if check is not None:
            assert proc.returncode == check, proc.stdout + proc.stderr
        return proc

    def spawn(self, *args: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO), "TEST_MARKER_DIR": str(self.path)}
        return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args, "--config", str(self.config)],
                                cwd=self.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def status(self, *args: str) -> dict:
        return json.loads(self.cli("status", "--json", *args, check=0).stdout)

    def outcomes(self, *args: str) -> dict[str, tuple[str, str | None]]:
        return {s["plugin"]: (s["outcome"], s["reason"]) for s in self.status(*args)["steps"]}

    def db(self):
        import sqlite3
        conn = sqlite3.connect(self.state / "orchestrator.db")
        conn.row_factory = sqlite3.Row
        return conn


def fault_run(project: Project, where: str, n: int, *args: str) -> subprocess.CompletedProcess:
    """The CLI on `project` through fault_run.py (a fault injected at `where`, see there)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run([sys.executable, str(Path(__file__).parent / "fault_run.py"), where, str(n), *args,
                           "--config", str(project.config)], cwd=project.path, env=env, capture_output=True,
                          text=True, timeout=120)


def make_project(path: Path, plugins: list[str] = MAIN_PLUGINS, extra: list[str] = (), policy: dict | None = None,
                 speed_timeout: float = 3) -> Project:
    shutil.copytree(FIXTURES / "target", path / "target")
    shutil.copytree(FIXTURES / "probes", path / "probes")
    (path / "plugins").mkdir()
    for name in plugins:
        shutil.copytree(FIXTURES / "plugins" / name, path / "plugins" / name)
    for name in extra:
        shutil.copytree(FIXTURES / "extra" / name, path / "plugins" / name)
    config = {
        "target": {"kind": "files", "root": "target"},
        "plugins": "plugins",
        "state": "state",
        "probes": [
            {"name": "correct", "role": "correctness", "command": ["python", "probes/correct.py"], "timeout": 30},
            {"name": "speed", "role": "throughput", "command": ["python", "probes/speed.py"],
             "timeout": speed_timeout, "objective": "score"},
        ],
        "policy": policy or {"interleave": False, "rule": "first", "repeats": 2},
    }
    (path / "orchestrator.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return Project(path)
