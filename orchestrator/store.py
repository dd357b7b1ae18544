"""The run history in SQLite (WAL): runs, steps, measurements, decisions, files, processes, events.

The schema's version is SQLite's `user_version`; a writer brings an older database up to date when it opens
it (`MIGRATIONS`), and a reader of an older one sees it as if it had been (temporary views, nothing written).
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from orchestrator.errors import UserError

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  id INTEGER PRIMARY KEY, command TEXT NOT NULL, status TEXT NOT NULL, pid INTEGER,
  config TEXT, target_kind TEXT, started REAL, finished REAL, detail TEXT, baseline TEXT);
CREATE TABLE IF NOT EXISTS steps (
  id INTEGER PRIMARY KEY, run_id INTEGER NOT NULL REFERENCES runs(id), seq INTEGER, plugin TEXT NOT NULL,
  params TEXT, state TEXT NOT NULL, image TEXT, outcome TEXT, reason TEXT, detail TEXT,
  gain REAL, objective TEXT, before_value REAL, after_value REAL, metrics TEXT, baseline_metrics TEXT,
  started REAL, finished REAL, duration REAL, kind TEXT NOT NULL DEFAULT 'attempt', control TEXT);
CREATE INDEX IF NOT EXISTS steps_run ON steps(run_id, seq);
CREATE INDEX IF NOT EXISTS steps_open ON steps(state);
CREATE TABLE IF NOT EXISTS files (
  id INTEGER PRIMARY KEY, step_id INTEGER NOT NULL REFERENCES steps(id), root TEXT NOT NULL,
  path TEXT NOT NULL, before TEXT, before_mode INTEGER, after TEXT, after_mode INTEGER, sealed INTEGER DEFAULT 0,
  UNIQUE(step_id, root, path));
CREATE TABLE IF NOT EXISTS trees (
  id INTEGER PRIMARY KEY, step_id INTEGER NOT NULL REFERENCES steps(id), root TEXT NOT NULL,
  manifest TEXT NOT NULL, UNIQUE(step_id, root));
CREATE TABLE IF NOT EXISTS roots (name TEXT PRIMARY KEY, location TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS deployed (
  plugin TEXT PRIMARY KEY, step_id INTEGER NOT NULL REFERENCES steps(id), kept_at REAL, params TEXT);
CREATE TABLE IF NOT EXISTS measurements (
  id INTEGER PRIMARY KEY, run_id INTEGER, step_id INTEGER, probe TEXT, role TEXT, arm TEXT, repeat INTEGER,
  ok INTEGER, reason TEXT, value REAL, metrics TEXT, duration REAL, returncode INTEGER,
  stdout_tail TEXT, stderr_tail TEXT, fingerprint TEXT, at REAL, server INTEGER, worker TEXT);
CREATE INDEX IF NOT EXISTS measurements_step ON measurements(run_id, step_id);
CREATE TABLE IF NOT EXISTS decisions (
  id INTEGER PRIMARY KEY, run_id INTEGER, step_id INTEGER REFERENCES steps(id), objective TEXT, verdict TEXT,
  gain REAL, ci_low REAL, ci_high REAL, n_baseline INTEGER, n_candidate INTEGER,
  baseline_median REAL, candidate_median REAL, rule TEXT, vetoes TEXT, policy TEXT, decision TEXT, at REAL);
CREATE INDEX IF NOT EXISTS decisions_step ON decisions(step_id);
CREATE TABLE IF NOT EXISTS processes (
  id INTEGER PRIMARY KEY, run_id INTEGER, step_id INTEGER, what TEXT, pid INTEGER, pgid INTEGER,
  create_time REAL, started REAL, ended REAL, ready REAL);
CREATE INDEX IF NOT EXISTS processes_open ON processes(ended);
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY, run_id INTEGER, step_id INTEGER, at REAL, kind TEXT, message TEXT);
CREATE TABLE IF NOT EXISTS calibrations (
  id INTEGER PRIMARY KEY, run_id INTEGER REFERENCES runs(id), objective TEXT, pairing TEXT, starts INTEGER,
  pairs INTEGER, within_sd REAL, between_sd REAL, between_df INTEGER, start_seconds REAL, pair_seconds REAL,
  summary TEXT, fingerprint TEXT, at REAL);
CREATE TABLE IF NOT EXISTS calibration_blocks (
  id INTEGER PRIMARY KEY, run_id INTEGER REFERENCES runs(id), step_id INTEGER REFERENCES steps(id), objective TEXT,
  pairing TEXT, pairs INTEGER, block TEXT, fingerprint TEXT, at REAL);
CREATE TABLE IF NOT EXISTS screenings (
  id INTEGER PRIMARY KEY, run_id INTEGER REFERENCES runs(id), workers INTEGER, candidates INTEGER, started REAL,
  finished REAL, busy REAL);
"""



# What a step is: a plugin staged (`attempt`), the re-validation of the stack a run kept (`final`, its `plugin`
# is "(final)"), the stack without one kept plugin (`attribution`, `plugin` is the one left out), a kept plugin
# re-judged by `run --reverify` (`reverify`), a kept plugin undone by `rollback` (`rollback`), one block of an
# A/A calibration (`calibration`, its `plugin` is "(A/A N)"), or a candidate measured on a screening worker against
# its own copy of the kept state (`screening`: rolled back there, or `measured` and then staged as an attempt).
# `control` holds the result of re-running a probe the candidate failed on the last kept state (JSON), if one was run.
STEP_KINDS = ("attempt", "final", "attribution", "reverify", "rollback", "calibration", "screening")

# Databases of schema version 0 name re-measurement steps "(final)" and "(without ID)" and have no kind: a run
# is a re-verification when one of its steps carries a mark only re-verification leaves (its rolled-back steps
# carry none, so a run that rolled back every stale plugin reads as attempts).
_V0_KIND = """CASE
  WHEN plugin = '(final)' THEN 'final'
  WHEN plugin LIKE '(without %)' THEN 'attribution'
  WHEN run_id IN (SELECT id FROM main.runs WHERE command = 'rollback') THEN 'rollback'
  WHEN run_id IN (SELECT run_id FROM main.steps WHERE reason IN ('reverified', 'files_changed')
                  OR (outcome = 'measured' AND plugin NOT LIKE '(%')
                  OR (outcome = 'skipped' AND reason = 'not_separable')) THEN 'reverify'
  ELSE 'attempt' END"""
_V0_PLUGIN = "CASE WHEN plugin LIKE '(without %)' THEN substr(plugin, 10, length(plugin) - 10) ELSE plugin END"


def _v1_step_kinds(conn: sqlite3.Connection, state_dir: Path) -> None:
    conn.execute("ALTER TABLE steps ADD COLUMN kind TEXT NOT NULL DEFAULT 'attempt'")
    conn.execute(f"UPDATE steps SET kind = {_V0_KIND}")
    conn.execute(f"UPDATE steps SET plugin = {_V0_PLUGIN} WHERE kind = 'attribution'")


def _v2_control(conn: sqlite3.Connection, state_dir: Path) -> None:
    conn.execute("ALTER TABLE steps ADD COLUMN control TEXT")


def _v3_relative_roots(conn: sqlite3.Connection, state_dir: Path) -> None:
    """Files and trees named their root by its absolute path, so a copied project acted on the original's target:
    the roots' locations move to their own table, relative to the state folder where they lie beside it."""
    conn.execute("CREATE TABLE roots (name TEXT PRIMARY KEY, location TEXT NOT NULL)")
    latest: dict[str, str] = {}
    for name, path in conn.execute("SELECT root, root_path FROM (SELECT step_id, root, root_path FROM files UNION "
                                   "ALL SELECT step_id, root, root_path FROM trees) ORDER BY step_id"):
        latest[name] = path
    conn.executemany("INSERT INTO roots (name, location) VALUES (?, ?)",
                     [(name, location(Path(path), state_dir)) for name, path in latest.items()])
    for table in ("files", "trees"):
        conn.execute(f"ALTER TABLE {table} DROP COLUMN root_path")


def _v4_path_images(conn: sqlite3.Connection, state_dir: Path) -> None:
    """Rows held files, or (kind 'dir') folders a step created; now every row holds images (images.py), so a
    created folder is a row whose post-image is "dir"."""
    conn.execute("UPDATE files SET after = 'dir', sealed = 1 WHERE kind = 'dir'")
    conn.execute("ALTER TABLE files DROP COLUMN kind")


def _v5_servers(conn: sqlite3.Connection, state_dir: Path) -> None:
    """Samples name the live server that served them (its processes row), servers when they answered their first
    health check, and A/A calibrations get a table (created with the rest of the schema)."""
    conn.execute("ALTER TABLE measurements ADD COLUMN server INTEGER")
    conn.execute("ALTER TABLE processes ADD COLUMN ready REAL")


def _v6_workers(conn: sqlite3.Connection, state_dir: Path) -> None:
    """Samples name the screening worker that measured them (NULL: the command itself), and each screening of a run
    gets a row (a table created with the rest of the schema)."""
    conn.execute("ALTER TABLE measurements ADD COLUMN worker TEXT")


def _v7_calibration_blocks(conn: sqlite3.Connection, state_dir: Path) -> None:
    """Each A/A block is recorded as it ends (a table created with the rest of the schema), so that a run cut short
    mid-calibration leaves the blocks it measured to the run that continues it."""


MIGRATIONS = [_v1_step_kinds, _v2_control, _v3_relative_roots, _v4_path_images, _v5_servers,
              _v6_workers, _v7_calibration_blocks]  # version v to v + 1
VERSION = len(MIGRATIONS)
# Step columns added since version 0, as a reader shows them in an older database.
_ADDED_STEP_COLUMNS = {"kind": _V0_KIND, "control": "NULL"}


def location(root: Path, state_dir: Path) -> str:
    """How the history names a root: relative to the state folder when both lie in the folder holding the state
    folder (a project copied or moved as a whole keeps its meaning), else absolute."""
    root, state_dir = Path(os.path.abspath(root)), Path(os.path.abspath(state_dir))
    if root.is_relative_to(state_dir.parent):
        return os.path.relpath(root, state_dir)
    return str(root)


def located(text: str, state_dir: Path) -> Path:
    """The folder a `location` names, seen from this state folder."""
    path = Path(text)
    return path if path.is_absolute() else Path(os.path.normpath(Path(os.path.abspath(state_dir)) / path))


def label(step: dict) -> str:
    """A step's name for people and for its probes (ORCHESTRATOR_PLUGIN): the plugin, "(final)", "(without ID)"."""
    return f"(without {step['plugin']})" if step["kind"] == "attribution" else step["plugin"]


MAX_TEXT = 4000  # characters of a detail, reason or message stored: a probe or a file may say far more
# characters of a configuration probe's result stored whole: a state's effective configuration (vLLM's resolved
# config runs to tens of thousands) is what a rollback "unmeasured, runs what the kept state runs" rests on, and it
# is read once a state, not once a sample
MAX_CONFIGURATION = 1_000_000


def bounded(text: str | None, limit: int = MAX_TEXT) -> str | None:
    """The text, or its head and tail with how much was cut between them."""
    if text is None or len(text) <= limit:
        return text
    keep = (limit - 40) // 2
    return f"{text[:keep]} [... {len(text) - 2 * keep} characters cut ...] {text[-keep:]}"


def bounded_metrics(metrics: Any, limit: int = 4 * MAX_TEXT) -> str | None:
    """A probe's result as JSON; one too long for the history keeps its numbers and says what it cut."""
    text = dumps(metrics)
    if text is None or len(text) <= limit or not isinstance(metrics, dict):
        return bounded(text, limit)
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return bounded(dumps({**numbers, "cut": f"{len(text)} characters of JSON; only its numbers are kept"}), limit)


def _without(row: dict, *keys: str) -> dict:
    return {k: v for k, v in row.items() if k not in keys}


def dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, default=str)


def loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


OPENED: list[Path] = []  # databases this process opened, newest last: an error of SQLite's names the file


class DamagedHistory(UserError):
    """The history database cannot be read or written."""


def problem(path: Path, e: sqlite3.DatabaseError) -> DamagedHistory:
    """A message for an SQLite failure that names the file and says what to do."""
    name = getattr(e, "sqlite_errorname", "") or ""
    if name == "SQLITE_FULL" or "disk is full" in str(e):
        return DamagedHistory(f"{path}: {e}: no space left on its device. Free some space, then run the command "
                              "again (the next `orchestrator recover`, `run` or `rollback` puts back what a stopped "
                              "run left)")
    if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_IOERR", "SQLITE_BUSY")):
        return DamagedHistory(f"{path}: {e} ({name}): check that the file and its folder can be read and written")
    return DamagedHistory(f"{path}: the history database is damaged ({e}); nothing was changed. Put it back from a "
                          f"backup; or, to start a new history, move the state folder {path.parent} aside (the target "
                          "stays as it is now, and what was kept can no longer be rolled back by the orchestrator)")


def has_history(path: Path) -> bool:
    """A database with something in it: in its file, or still only in its write-ahead log (a new database's first
    transactions stay there until a checkpoint). SQLite reads a zero-length file as an empty database."""
    for file in (Path(path), Path(f"{path}-wal")):
        try:
            if file.stat().st_size > 0:
                return True
        except FileNotFoundError:
            continue
    return False


BUSY_TIMEOUT_MS = 10_000  # how long a statement waits for another connection's lock


class Reader:
    """The history, read only: `status` and `report` use it while a run may be writing (WAL readers never block).
    Plain sqlite3, so reading imports none of the write machinery."""

    def __init__(self, path: Path):
        self.path = Path(path)
        OPENED.append(self.path)
        self._lost_history()
        try:
            self.conn = self._connect()
            self.conn.row_factory = sqlite3.Row
            self.conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self.conn.execute("PRAGMA schema_version").fetchone()  # reads the header: "file is not a database"
            self._check()
            self._as_current()
        except sqlite3.DatabaseError as e:
            raise problem(self.path, e) from None

    def _lost_history(self) -> None:
        """A zero-length database beside recorded pre-images: the history was lost, not never written."""
        if self.path.exists() and not has_history(self.path):
            blobs = self.path.parent / "blobs"
            count = sum(1 for p in blobs.iterdir() if not p.name.startswith(".")) if blobs.is_dir() else 0
            if count:
                raise DamagedHistory(f"{self.path} is empty (0 bytes) although {blobs} holds {count} recorded "
                                     "image(s): the history was lost. Put the database back from a backup; or, to "
                                     f"start a new history, move the state folder {self.path.parent} aside (the "
                                     "target stays as it is now, and what was kept can no longer be rolled back by "
                                     "the orchestrator)")

    def _check(self) -> None:
        """A reader trusts SQLite to report damage in what it reads; a writer checks the whole file first."""

    def _connect(self) -> sqlite3.Connection:
        self._roll_back_hot_journal()
        return sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)

    def _roll_back_hot_journal(self) -> None:
        """A command killed while it created the database (before the switch to WAL) leaves a hot rollback
        journal, which a read-only connection may not roll back (SQLITE_READONLY_ROLLBACK). Any read through a
        writable connection rolls it back, as SQLite's own crash recovery; without write access the read-only
        connection then names the file."""
        if not Path(f"{self.path}-journal").exists():
            return
        try:
            conn = sqlite3.connect(self.path, timeout=10)
            try:
                conn.execute("PRAGMA schema_version").fetchone()
            finally:
                conn.close()
        except sqlite3.DatabaseError:
            pass

    def _as_current(self) -> None:
        """Show an older database as the current schema: a temporary view named like the table hides it."""
        columns = [r["name"] for r in self.conn.execute("PRAGMA main.table_info(steps)")]
        missing = [c for c in _ADDED_STEP_COLUMNS if c not in columns]
        if not columns or not missing:
            return
        shown = [f"{_V0_PLUGIN} AS plugin" if c == "plugin" and "kind" in missing else c for c in columns]
        shown += [f"{_ADDED_STEP_COLUMNS[c]} AS {c}" for c in missing]
        self.conn.execute(f"CREATE TEMP VIEW steps AS SELECT {', '.join(shown)} FROM main.steps")

    def close(self) -> None:
        self.conn.close()

    def empty(self) -> bool:
        """No table yet: a command was stopped while it created the database."""
        return not self.query("SELECT 1 FROM sqlite_master WHERE name = 'runs'")

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[dict]:
        return [dict(r) for r in self.conn.execute(sql, list(params))]

    # runs
    def run(self, run_id: int | None = None, command: str | None = "run") -> dict | None:
        if run_id is not None:
            rows = self.query("SELECT * FROM runs WHERE id = ?", [run_id])
        elif command:
            rows = self.query("SELECT * FROM runs WHERE command = ? ORDER BY id DESC LIMIT 1", [command])
        else:
            rows = self.query("SELECT * FROM runs ORDER BY id DESC LIMIT 1")
        return rows[0] if rows else None

    def runs(self) -> list[dict]:
        return self.query(
            "SELECT r.*, SUM(s.outcome = 'kept') AS kept, SUM(s.outcome = 'rolled_back') AS rolled_back, "
            "SUM(s.outcome = 'skipped') AS skipped FROM runs r LEFT JOIN steps s ON s.run_id = r.id "
            "GROUP BY r.id ORDER BY r.id")

    def runs_before(self, run_id: int, command: str) -> list[dict]:
        """Earlier runs of a command, newest first."""
        return self.query("SELECT * FROM runs WHERE id < ? AND command = ? ORDER BY id DESC", [run_id, command])

    def open_runs(self) -> list[dict]:
        return self.query("SELECT * FROM runs WHERE status = 'running' ORDER BY id")

    # steps
    def step(self, step_id: int) -> dict:
        return self.query("SELECT * FROM steps WHERE id = ?", [step_id])[0]

    def step_or_none(self, step_id: int) -> dict | None:
        rows = self.query("SELECT * FROM steps WHERE id = ?", [step_id])
        return rows[0] if rows else None

    def steps(self, run_id: int) -> list[dict]:
        return self.query("SELECT * FROM steps WHERE run_id = ? ORDER BY seq", [run_id])

    def open_steps(self) -> list[dict]:
        return self.query("SELECT * FROM steps WHERE state != 'done' ORDER BY id DESC")

    # files and trees
    def file_rows(self, step_id: int) -> list[dict]:
        return self.query("SELECT * FROM files WHERE step_id = ? ORDER BY id", [step_id])

    def tree_rows(self, step_id: int) -> list[dict]:
        return self.query("SELECT * FROM trees WHERE step_id = ? ORDER BY id", [step_id])

    def roots(self) -> dict[str, str]:
        """{root name: location} of the roots the history's files lie in (see `location`); for a database older
        than schema version 3, as its migration will record them."""
        if self.query("SELECT 1 FROM sqlite_master WHERE name = 'roots'"):
            return {r["name"]: r["location"] for r in self.query("SELECT * FROM roots ORDER BY name")}
        latest = {r["root"]: r["root_path"] for r in self.query(
            "SELECT step_id, root, root_path FROM files UNION ALL SELECT step_id, root, root_path FROM trees "
            "ORDER BY step_id")}
        return {name: location(Path(path), self.path.parent) for name, path in latest.items()}

    def roots_in_use(self) -> set[str]:
        """Names of the roots whose files a kept plugin or an unfinished step recorded: where they are matters."""
        return {r["root"] for r in self.query(
            "SELECT root FROM files WHERE step_id IN (SELECT step_id FROM deployed) OR step_id IN "
            "(SELECT id FROM steps WHERE state != 'done') UNION SELECT root FROM trees WHERE step_id IN "
            "(SELECT id FROM steps WHERE state != 'done')")}

    # deployment
    def deployed(self) -> dict[str, dict]:
        return {r["plugin"]: r for r in self.query("SELECT * FROM deployed ORDER BY kept_at, step_id")}

    # measurements, decisions, processes
    def measurements(self, step_id: int | None, run_id: int) -> list[dict]:
        if step_id is None:
            return self.query("SELECT * FROM measurements WHERE run_id = ? AND step_id IS NULL ORDER BY id",
                              [run_id])
        return self.query("SELECT * FROM measurements WHERE step_id = ? ORDER BY id", [step_id])

    def samples_on_servers_of(self, step_id: int) -> list[dict]:
        """Every throughput sample taken on the live servers that served the step's candidate, whatever step it
        was taken for: a kept candidate's server serves the kept state after it."""
        return self.query("SELECT * FROM measurements WHERE role = 'throughput' AND ok = 1 AND server IN "
                          "(SELECT server FROM measurements WHERE step_id = ? AND arm = 'candidate' AND role = "
                          "'throughput' AND server IS NOT NULL) ORDER BY id", [step_id])

    def fingerprint_of(self, step_id: int) -> dict | None:
        """The environment a step's decision was measured in: its last throughput sample's fingerprint."""
        rows = self.query("SELECT fingerprint FROM measurements WHERE step_id = ? AND role = 'throughput' "
                          "AND fingerprint IS NOT NULL ORDER BY id DESC LIMIT 1", [step_id])
        return loads(rows[0]["fingerprint"]) if rows else None

    def decisions_for(self, step_ids: Iterable[int]) -> dict[int, dict]:
        ids = list(step_ids)
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        return {r["step_id"]: r for r in self.query(
            f"SELECT * FROM decisions WHERE step_id IN ({marks}) ORDER BY id", ids)}

    def calibrations(self) -> list[dict]:
        """Every A/A calibration recorded, newest first (none in a database older than schema version 5)."""
        if not self.query("SELECT 1 FROM sqlite_master WHERE name = 'calibrations'"):
            return []
        return self.query("SELECT * FROM calibrations ORDER BY id DESC")

    def calibration_of(self, run_id: int) -> dict | None:
        return next((c for c in self.calibrations() if c["run_id"] == run_id), None)

    def calibration_blocks(self, run_ids: Iterable[int]) -> list[dict]:
        """The A/A blocks these runs measured, oldest first (none in a database older than schema version 7)."""
        runs = list(run_ids)
        if not runs or not self.query("SELECT 1 FROM sqlite_master WHERE name = 'calibration_blocks'"):
            return []
        marks = ", ".join("?" * len(runs))
        return self.query(f"SELECT * FROM calibration_blocks WHERE run_id IN ({marks}) ORDER BY id", runs)

    def recorded(self) -> dict[str, list[dict]]:
        """Every process, measurement, decision and event: what a screening worker's own history holds of its step."""
        return {table: self.query(f"SELECT * FROM {table} ORDER BY id")
                for table in ("processes", "measurements", "decisions", "events")}

    def screenings(self, run_id: int) -> list[dict]:
        """A run's screenings, oldest first (none in a database older than schema version 6)."""
        if not self.query("SELECT 1 FROM sqlite_master WHERE name = 'screenings'"):
            return []
        return self.query("SELECT * FROM screenings WHERE run_id = ? ORDER BY id", [run_id])

    def workers_of(self, run_id: int) -> dict[int, list[str]]:
        """{step id: the screening workers that measured its samples, in the order they first did}."""
        if "worker" not in {r["name"] for r in self.query("PRAGMA main.table_info(measurements)")}:
            return {}
        out: dict[int, list[str]] = {}
        for r in self.query("SELECT step_id, worker FROM measurements WHERE run_id = ? AND worker IS NOT NULL "
                            "ORDER BY id", [run_id]):
            if r["worker"] not in out.setdefault(r["step_id"], []):
                out[r["step_id"]].append(r["worker"])
        return out

    def servers(self, run_id: int) -> list[dict]:
        """The live servers a run started (processes rows), oldest first."""
        return self.query("SELECT * FROM processes WHERE run_id = ? AND what LIKE 'live server%' ORDER BY id",
                          [run_id])

    def open_processes(self) -> list[dict]:
        return self.query("SELECT * FROM processes WHERE ended IS NULL ORDER BY id")

    def events(self, run_id: int, kinds: Iterable[str]) -> list[dict]:
        """A run's events of these kinds, oldest first."""
        kinds = list(kinds)
        return self.query(f"SELECT * FROM events WHERE run_id = ? AND kind IN ({', '.join('?' * len(kinds))}) "
                          "ORDER BY id", [run_id, *kinds])


class Store(Reader):
    """The history, written. Every write commits before returning, except inside `transaction()`, where the
    writes of the block commit together or not at all; so the database always reflects what has happened."""

    def __init__(self, path: Path):
        import sqlite_utils
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        super().__init__(path)
        try:
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
            self._db = sqlite_utils.Database(self.conn, execute_plugins=False)
            self._migrate()
        except sqlite3.DatabaseError as e:
            raise problem(self.path, e) from None

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(str(self.path))

    def _check(self) -> None:
        found = [r[0] for r in self.conn.execute("PRAGMA quick_check(3)")]
        if found != ["ok"]:
            raise DamagedHistory(f"{self.path}: the history database is damaged (integrity check: "
                                 f"{'; '.join(found)}); nothing was changed. Put it back from a backup; or, to start "
                                 f"a new history, move the state folder {self.path.parent} aside")

    def _as_current(self) -> None:
        """A writer migrates instead (`_migrate`)."""

    def _migrate(self) -> None:
        """Create the tables, or bring an older database up to VERSION in one transaction; refuse a newer one."""
        fresh = not self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'steps'").fetchone()
        version = VERSION if fresh else self.conn.execute("PRAGMA user_version").fetchone()[0]
        if version > VERSION:
            raise UserError(f"{self.path}: written by a newer release of the orchestrator (schema version "
                            f"{version}; this one knows up to {VERSION})")
        if version == VERSION and not fresh:
            return
        with self.transaction():
            for migration in MIGRATIONS[version:]:
                migration(self.conn, self.path.parent)
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    self.conn.execute(statement)
            self.conn.execute(f"PRAGMA user_version = {VERSION}")

    def checkpoint(self) -> bool:
        """Copy the write-ahead log into the database file and empty it; False when a reader held part of it back.
        It never waits: a TRUNCATE checkpoint waits for every reader's snapshot through the busy handler, so a
        reader holding a read transaction (`status`, sqlite3) would delay every command by the busy timeout."""
        self.conn.execute("PRAGMA busy_timeout=0")
        try:
            busy, _, _ = self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            self.conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        return busy == 0

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Group writes: they commit together when the block ends, or none of them if it raises (nestable)."""
        with self._db.atomic():
            yield

    # runs
    def start_run(self, command: str, config: str | None, target_kind: str | None) -> int:
        return self._db["runs"].insert(dict(command=command, status="running", pid=os.getpid(), config=config,
                                            target_kind=target_kind, started=time.time())).last_pk

    def update_run(self, run_id: int, **fields: Any) -> None:
        if "detail" in fields:
            fields["detail"] = bounded(fields["detail"])
        self._db["runs"].update(run_id, fields)

    def finish_run(self, run_id: int, status: str, detail: str | None = None) -> None:
        self.update_run(run_id, status=status, finished=time.time(), detail=detail)

    # steps
    def new_step(self, run_id: int, plugin: str, state: str, params: dict | None = None, kind: str = "attempt",
                 **fields: Any) -> int:
        assert kind in STEP_KINDS, kind
        seq = self.conn.execute("SELECT COUNT(*) FROM steps WHERE run_id = ?", [run_id]).fetchone()[0]
        return self._db["steps"].insert(dict(run_id=run_id, seq=seq, plugin=plugin, params=dumps(params or None),
                                             state=state, kind=kind, started=time.time(), **fields)).last_pk

    def set_step(self, step_id: int, **fields: Any) -> None:
        for key in ("reason", "detail", "control"):
            if key in fields:
                fields[key] = bounded(fields[key])
        self._db["steps"].update(step_id, fields)

    def finish_step(self, step_id: int, outcome: str, reason: str | None, detail: str | None = None,
                    finished: float | None = None, **fields: Any) -> None:
        """`finished`: when the step's work ended, if that was before now (an A/A block judged after the last)."""
        started = self.step(step_id)["started"] or time.time()
        now = finished or time.time()
        self.set_step(step_id, state="done", outcome=outcome, reason=reason, detail=detail, finished=now,
                      duration=now - started, **fields)

    # files and trees
    def add_files(self, rows: list[dict]) -> None:
        """Path rows: pre-images recorded before a step touches anything, or (switch steps) images already stored."""
        if rows:
            self._db["files"].insert_all(rows)

    def set_file(self, file_id: int, **fields: Any) -> None:
        self._db["files"].update(file_id, fields)

    def add_tree(self, step_id: int, root: str, manifest: str) -> None:
        self._db["trees"].insert(dict(step_id=step_id, root=root, manifest=manifest))

    def set_roots(self, roots: dict[str, str]) -> None:
        """Where the roots are now ({name: location}); names not given keep theirs."""
        with self.transaction():
            self.conn.executemany("INSERT OR REPLACE INTO roots (name, location) VALUES (?, ?)", list(roots.items()))

    def swap_images(self, step_id: int) -> None:
        """Exchange each file row's before and after images."""
        with self.transaction():
            self.conn.execute("UPDATE files SET before = after, before_mode = after_mode, after = before, "
                              "after_mode = before_mode WHERE step_id = ?", [step_id])

    # deployment
    def deploy(self, plugin: str, step_id: int, params: dict | None, kept_at: float | None = None) -> None:
        """`kept_at` keeps a re-judged plugin at its place in the deployment order (rollback goes newest first)."""
        self._db["deployed"].upsert(dict(plugin=plugin, step_id=step_id, kept_at=kept_at or time.time(),
                                         params=dumps(params or None)), pk="plugin")

    def undeploy(self, plugin: str) -> None:
        with self.transaction():
            self.conn.execute("DELETE FROM deployed WHERE plugin = ?", [plugin])

    # measurements, decisions, events, processes
    def add_measurement(self, **row: Any) -> None:
        row["metrics"] = bounded_metrics(row.get("metrics"),
                                         MAX_CONFIGURATION if row.get("role") == "configuration" else 4 * MAX_TEXT)
        row["reason"] = bounded(row.get("reason"))
        row["fingerprint"] = dumps(row.get("fingerprint"))
        self._db["measurements"].insert(dict(at=time.time(), **row))

    def add_decision(self, run_id: int, step_id: int, objective: str, decision: dict, vetoes: list[str],
                     policy: dict) -> None:
        fields = {k: decision.get(k) for k in ("verdict", "gain", "ci_low", "ci_high", "n_baseline", "n_candidate",
                                                "baseline_median", "candidate_median", "rule")}
        self._db["decisions"].insert(dict(run_id=run_id, step_id=step_id, objective=objective, **fields,
                                          vetoes=dumps(vetoes), policy=dumps(policy), decision=dumps(decision),
                                          at=time.time()))

    def event(self, run_id: int | None, kind: str, message: str, step_id: int | None = None) -> None:
        self._db["events"].insert(dict(run_id=run_id, step_id=step_id, at=time.time(), kind=kind,
                                       message=bounded(message)))

    def add_process(self, run_id: int | None, step_id: int | None, what: str, pid: int, pgid: int,
                    create_time: float) -> int:
        return self._db["processes"].insert(dict(run_id=run_id, step_id=step_id, what=what, pid=pid, pgid=pgid,
                                                 create_time=create_time, started=time.time())).last_pk

    def end_process(self, proc_id: int) -> None:
        self._db["processes"].update(proc_id, {"ended": time.time()})

    def process_ready(self, proc_id: int) -> None:
        """A live server answered its first health check."""
        self._db["processes"].update(proc_id, {"ready": time.time()})

    def add_measured(self, run_id: int, step_id: int, worker: str, processes: list[dict], measurements: list[dict],
                     decisions: list[dict] = (), events: list[dict] = ()) -> dict[int, int]:
        """What a screening worker recorded of one step in its own history, as this step's: its processes (new ids;
        returns {its id: id here}), its measurements (each sample's server mapped, its worker named: `worker` where
        the row names none), decisions and events. In one commit."""
        ids: dict[int, int] = {}
        with self.transaction():
            for row in processes:
                ids[row["id"]] = self._db["processes"].insert(
                    {**_without(row, "id"), "run_id": run_id, "step_id": step_id}).last_pk
            for row in measurements:
                self._db["measurements"].insert({**_without(row, "id"), "run_id": run_id, "step_id": step_id,
                                                 "server": ids.get(row["server"]), "worker": row.get("worker") or worker})
            for row in decisions:
                self._db["decisions"].insert({**_without(row, "id"), "run_id": run_id, "step_id": step_id})
            for row in events:
                self._db["events"].insert({**_without(row, "id"), "run_id": run_id, "step_id": step_id})
        return ids

    def add_screening(self, run_id: int, workers: int, candidates: int, started: float, busy: float) -> None:
        """A screening ended: `busy`, the seconds one worker would have spent measuring its candidates in turn."""
        self._db["screenings"].insert(dict(run_id=run_id, workers=workers, candidates=candidates, started=started,
                                           finished=time.time(), busy=busy))

    def add_calibration(self, run_id: int, **fields: Any) -> int:
        fields["summary"] = dumps(fields.get("summary"))
        fields["fingerprint"] = dumps(fields.get("fingerprint"))
        return self._db["calibrations"].insert(dict(run_id=run_id, at=time.time(), **fields)).last_pk

    def add_calibration_block(self, run_id: int, step_id: int, objective: str | None, pairing: str, pairs: int,
                              block: dict, fingerprint: dict | None) -> None:
        self._db["calibration_blocks"].insert(dict(run_id=run_id, step_id=step_id, objective=objective,
                                                   pairing=pairing, pairs=pairs, block=dumps(block),
                                                   fingerprint=dumps(fingerprint), at=time.time()))
