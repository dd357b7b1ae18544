"""Step and check kinds: replace, deploy, yaml_set, command, python; contains, yaml_has, command, python.

Declarative steps compute the new bytes from a reader, so `plan` can show a diff without writing; a command or
python step's process runs under a keeper (probes/keeper.py), which records what it changed.
"""
from __future__ import annotations

import io
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap

from orchestrator.journal import Journal, TouchError, write_image
from orchestrator.loading import ConfigError
from orchestrator.plugin import Check, Step, UndoStep, confine
from orchestrator.probes.runner import Keeper, ProcessResult, run_process

PROCESS_KINDS = ("command", "python")
FILE_CHECKS = ("contains", "yaml_has")  # checks read from the files alone: `plan` evaluates them
_ABSENT = object()
HOOK_RUNNER = Path(__file__).resolve().parent / "hook_runner.py"
Reader = Callable[[Path], "bytes | None"]


class StepFailed(Exception):
    def __init__(self, message: str, result: ProcessResult | None = None):
        super().__init__(message)
        self.result = result


@dataclass
class StepContext:
    """Where a plugin's steps act and how their processes are started and recorded."""

    roots: dict[str, Path]
    kind: str
    plugin_dir: Path
    env: dict[str, str]
    journal: Journal | None = None
    step_id: int | None = None
    on_start: Callable | None = None
    on_tick: Callable | None = None
    tmp_dir: Path | None = None

    def root_of(self, action) -> tuple[str, Path]:
        name = action.root or next(iter(self.roots))
        return name, self.roots[name]


def read_disk(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def _path(ctx: StepContext, action, rel: str) -> tuple[str, Path, Path]:
    name, root = ctx.root_of(action)
    try:
        return name, root, confine(root, rel)
    except ConfigError as e:
        raise StepFailed(e.message) from None


def _text(data: bytes, rel: str, kind: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StepFailed(f"{kind}: {rel} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                         "it works on text files only") from None


def compute(step: Step, ctx: StepContext, read: Reader) -> tuple[str, Path, Path, bytes]:
    """(root name, root, file, new bytes) of a declarative step, without writing anything."""
    body = step.body
    if step.kind == "replace":
        name, root, full = _path(ctx, step, body.path)
        data = read(full)
        if data is None:
            raise StepFailed(f"replace: {body.path} does not exist")
        text = _text(data, body.path, "replace")
        found = text.count(body.old)
        if found != body.count:
            raise StepFailed(f"replace: expected {body.count} match(es) of {body.old!r} in {body.path}, found {found}")
        return name, root, full, text.replace(body.old, body.new).encode("utf-8")
    if step.kind == "deploy":
        try:
            src = confine(ctx.plugin_dir, body.src)
        except ConfigError as e:
            raise StepFailed(e.message) from None
        if not src.is_file():
            raise StepFailed(f"deploy: {body.src} is not a file in {ctx.plugin_dir}")
        name, root, full = _path(ctx, step, body.dest)
        return name, root, full, src.read_bytes()
    if step.kind == "yaml_set":
        name, root, full = _path(ctx, step, body.path)
        data = read(full)
        return name, root, full, yaml_set(_text(data, body.path, "yaml_set") if data is not None else "", body.key,
                                          body.value, body.path)
    raise ValueError(f"{step.kind} is not declarative")


def compute_all(steps: list[Step], ctx: StepContext, read: Reader) -> dict[Path, tuple[str, Path, bytes | None, bytes]]:
    """{file: (root name, root, its bytes before, its bytes after)} of declarative steps applied in order, each on
    what the ones before it left, without writing anything."""
    changes: dict[Path, tuple[str, Path, bytes | None, bytes]] = {}

    def current(path: Path) -> bytes | None:
        return changes[path][3] if path in changes else read(path)

    for step in steps:
        name, root, full, data = compute(step, ctx, current)
        changes[full] = (name, root, changes[full][2] if full in changes else read(full), data)
    return changes


def yaml_set(text: str, key: str, value: Any, where: str) -> bytes:
    """Set a dotted key in YAML text, keeping comments, quotes and key order."""
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    try:
        doc = yaml.load(text) if text.strip() else None
    except Exception as e:  # noqa: BLE001 - any parse error of the user's file fails the step
        raise StepFailed(f"yaml_set: cannot parse {where}: {e}") from None
    if doc is None:
        doc = CommentedMap()
    parts = key.split(".")
    node = doc
    for i, part in enumerate(parts[:-1]):
        child = _child(node, part)
        if (child is _ABSENT or child is None) and isinstance(node, dict):
            child = node[part] = CommentedMap()
        elif child is _ABSENT:
            raise StepFailed(f"yaml_set: {where}: {'.'.join(parts[:i + 1])} is not a mapping")
        node = child
    last = parts[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise StepFailed(f"yaml_set: {where}: {'.'.join(parts[:-1])} is not a mapping")
    out = io.StringIO()
    yaml.dump(doc, out)
    return out.getvalue().encode("utf-8")


def yaml_get(text: str, key: str, where: str) -> Any:
    """The value at a dotted key (digits index lists) of YAML text, or _ABSENT."""
    try:
        node = YAML(typ="safe", pure=True).load(text) if text.strip() else None
    except Exception as e:  # noqa: BLE001 - any parse error of the file fails the check
        raise StepFailed(f"yaml_has: cannot parse {where}: {e}") from None
    for part in key.split("."):
        node = _child(node, part)
        if node is _ABSENT:
            break
    return node


def _child(node: Any, part: str) -> Any:
    """One part of a dotted key: a mapping's key, or a list's index in digits; _ABSENT where there is none."""
    if isinstance(node, list) and part.isdigit() and int(part) < len(node):
        return node[int(part)]
    if isinstance(node, dict) and part in node:
        return node[part]
    return _ABSENT


def _same(found: Any, value: Any) -> bool:
    """Equal as YAML means it: `true` is not `1`."""
    return found == value and isinstance(found, bool) == isinstance(value, bool)


def _run(ctx: StepContext, action, argv: list[str], timeout: float, what: str, keeper: Keeper | None) -> ProcessResult:
    _, root = ctx.root_of(action)
    env = {**ctx.env, "ORCHESTRATOR_PLUGIN_DIR": str(ctx.plugin_dir)}
    return run_process(argv, root, env, timeout, on_start=ctx.on_start and (lambda pid, ct: ctx.on_start(what, pid, ct)),
                       on_tick=ctx.on_tick, tmp_dir=ctx.tmp_dir, keeper=keeper)


def _process(ctx: StepContext, action, mode: str, keeper: Keeper | None = None) -> ProcessResult:
    body = action.body
    if action.kind == "command":
        return _run(ctx, action, body.run, body.timeout, f"command {' '.join(body.run)}", keeper)
    argv = [sys.executable, str(HOOK_RUNNER), str(ctx.plugin_dir), body.function, json.dumps(body.args), mode]
    return _run(ctx, action, argv, body.timeout, f"python {body.function}", keeper)


def _describe(result: ProcessResult, timeout: float) -> str:
    if result.launch_error:
        return result.launch_error
    if result.timed_out:
        return f"timed out after {timeout:g}s"
    if result.signal:
        return f"ended by signal {result.signal}"
    tail = (result.stderr_tail.strip() or result.stdout_tail.strip()).splitlines()[-3:]
    return f"exited with status {result.returncode}" + (f": {' | '.join(tail)}" if tail else "")


def apply_all(steps: list[Step], ctx: StepContext) -> None:
    """Apply in order, recording first what recovery needs to tell the step's changes from anyone else's."""
    for process, run in itertools.groupby(steps, key=lambda s: s.kind in PROCESS_KINDS):
        for step in run if process else [list(run)]:
            (run_command if process else write_all)(step, ctx)


def run_command(step: Step, ctx: StepContext) -> None:
    """A command or python step: its root is snapshotted, and its process runs under a keeper."""
    name, root = ctx.root_of(step)
    snapshot = ctx.journal.track_tree(ctx.step_id, name, root)
    keeper = Keeper(ctx.journal.state_dir, {**ctx.journal.identity(ctx.step_id), "root": name}, root,
                    ctx.journal.blobs / snapshot)
    result = _process(ctx, step, "apply", keeper)
    if result.timed_out or result.returncode != 0:
        raise StepFailed(f"{step.kind}: {_describe(result, step.body.timeout)}", result)


def write_all(steps: list[Step], ctx: StepContext) -> None:
    """A run of declarative steps: computed whole, its pre-images and the bytes it will write recorded in one go,
    then each file written once."""
    changes = compute_all(steps, ctx, read_disk)
    try:
        ctx.journal.track_writes(ctx.step_id, [(name, root, str(full.relative_to(root)), old, new)
                                               for full, (name, root, old, new) in changes.items()])
    except TouchError as e:
        raise StepFailed(str(e)) from None
    for full, (_, _, _, new) in changes.items():
        full.parent.mkdir(parents=True, exist_ok=True)
        write_image(full, new)


def undo_step(step: UndoStep, ctx: StepContext) -> None:
    result = _process(ctx, step, "apply")
    if result.timed_out or result.returncode != 0:
        raise StepFailed(f"rollback {step.kind}: {_describe(result, step.body.timeout)}", result)


def check(chk: Check, ctx: StepContext, read: Reader = read_disk) -> tuple[bool, str]:
    """(passed, why) for a precondition or a verification."""
    if chk.kind == "contains":
        _, _, full = _path(ctx, chk, chk.body.path)
        data = read(full)
        if data is None:
            return False, f"{chk.body.path} does not exist"
        if chk.body.text.encode("utf-8") in data:
            return True, f"{chk.body.path} contains {chk.body.text!r}"
        return False, f"{chk.body.path} does not contain {chk.body.text!r}"
    if chk.kind == "yaml_has":
        body = chk.body
        _, _, full = _path(ctx, chk, body.path)
        data = read(full)
        if data is None:
            return False, f"{body.path} does not exist"
        try:
            found = yaml_get(_text(data, body.path, "yaml_has"), body.key, body.path)
        except StepFailed as e:
            return False, str(e)
        if found is _ABSENT:
            return False, f"{body.path} has no {body.key}"
        if _same(found, body.value):
            return True, f"{body.path}: {body.key} is {body.value!r}"
        return False, f"{body.path}: {body.key} is {found!r}, not {body.value!r}"
    result = _process(ctx, chk, "check")
    if result.timed_out or result.returncode != 0:
        return False, f"{chk.kind}: {_describe(result, chk.body.timeout)}"
    return True, f"{chk.kind} passed"
