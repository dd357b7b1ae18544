"""Plugin manifests (plugin.yaml): schema, loading, `${var}` substitution, path confinement and ordering."""
from __future__ import annotations

import heapq
import itertools
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from orchestrator.policy import Accept
from orchestrator.loading import STRICT, ConfigError, dotted, line_of, read_yaml, validate
from orchestrator.targets import KINDS

MANIFEST = "plugin.yaml"
MAX_VARIANTS = 64  # params combinations of one plugin: each is applied, probed and measured
Kind = Literal["files", "engine", "vllm"]
# a plugin's id names its folder, log files and table rows: readable, and well within a file name's 255 bytes
PluginId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=128)]


class _Strict(BaseModel):
    model_config = STRICT


class Replace(_Strict):
    path: str
    old: str = Field(min_length=1)
    new: str
    count: int = Field(1, ge=1)


class Deploy(_Strict):
    src: str
    dest: str


class YamlSet(_Strict):
    path: str
    key: str = Field(min_length=1)
    value: Any


class Command(_Strict):
    run: list[str] = Field(min_length=1)
    timeout: float = Field(300, gt=0)


class Python(_Strict):
    function: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    args: dict[str, Any] = Field(default_factory=dict)
    timeout: float = Field(300, gt=0)


class Contains(_Strict):
    path: str
    text: str


class YamlHas(_Strict):
    """yaml_set's check: the parsed value, whatever the file's layout (a flow mapping writes no `key: value` line)."""

    path: str
    key: str = Field(min_length=1)
    value: Any


def _one_kind(kinds: tuple[str, ...]):
    def check(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError(f"expected a mapping with one of: {', '.join(kinds)}")
        present = [k for k in data if k not in ("root", "target")]
        unknown = [k for k in present if k not in kinds]
        if unknown:
            raise ValueError(f"unknown kind {unknown[0]!r} (expected one of: {', '.join(kinds)})")
        if len(present) != 1:
            raise ValueError(f"needs exactly one of: {', '.join(kinds)}")
        return data
    return model_validator(mode="before")(classmethod(check))


class _Action(_Strict):
    root: str | None = None  # a named root of the target; default: its first
    target: Kind | list[Kind] | None = None  # run only on these target kinds

    @property
    def kind(self) -> str:
        return next(k for k in self.model_fields_set if k not in ("root", "target"))

    @property
    def body(self) -> Any:
        return getattr(self, self.kind)

    def runs_on(self, kind: str) -> bool:
        return self.target is None or kind in ([self.target] if isinstance(self.target, str) else self.target)


class Step(_Action):
    """One change: exactly one of replace, deploy, yaml_set, command, python."""

    replace: Replace | None = None
    deploy: Deploy | None = None
    yaml_set: YamlSet | None = None
    command: Command | None = None
    python: Python | None = None
    _kinds = _one_kind(("replace", "deploy", "yaml_set", "command", "python"))


class UndoStep(_Action):
    """An explicit rollback step; files are restored before these run, so they may not edit files."""

    command: Command | None = None
    python: Python | None = None
    _kinds = _one_kind(("command", "python"))


class Check(_Action):
    """A precondition or a verification: exactly one of contains, yaml_has, command, python."""

    contains: Contains | None = None
    yaml_has: YamlHas | None = None
    command: Command | None = None
    python: Python | None = None
    _kinds = _one_kind(("contains", "yaml_has", "command", "python"))


class Manifest(_Strict):
    id: PluginId
    description: str = ""
    order: int = 100
    requires: list[str] = Field(default_factory=list)
    after: list[str] = Field(default_factory=list)
    targets: list[Kind] = Field(default_factory=lambda: list(KINDS))
    applies_if: list[Check] = Field(default_factory=list)
    params: dict[str, list[Any]] = Field(default_factory=dict)
    apply: list[Step] = Field(min_length=1)
    verify: list[Check] = Field(default_factory=list)
    rollback: list[UndoStep] = Field(default_factory=list)
    accept: Accept | None = None  # type: ignore[valid-type]
    # The change alters the model's arithmetic on purpose (e.g. an fp8 KV cache): greedy outputs are then
    # judged by agreement with the baseline's, not equality (the probe reads NUMERICS_ENV).
    changes_numerics: bool = False

    @model_validator(mode="after")
    def _params(self) -> "Manifest":
        for name, values in self.params.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"params: {name!r} is not a valid name")
            if not values:
                raise ValueError(f"params.{name}: needs at least one candidate value")
        combos = math.prod(len(v) for v in self.params.values())
        if combos > MAX_VARIANTS:
            sizes = " x ".join(str(len(v)) for v in self.params.values())
            raise ValueError(f"params: {sizes} = {combos} combinations, more than the limit of {MAX_VARIANTS} "
                             "(each is staged and measured like a plugin); search fewer values at a time")
        return self


SECTIONS = ("applies_if", "apply", "verify", "rollback")
_VAR = re.compile(r"\$(\$|\{([A-Za-z_][A-Za-z0-9_]*)\})")


def substitute(value: Any, variables: dict[str, Any]) -> Any:
    """Replace `${name}` in every string; a string that is only `${name}` takes the value's own type."""
    if isinstance(value, dict):
        return {k: substitute(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, variables) for v in value]
    if not isinstance(value, str):
        return value
    whole = _VAR.fullmatch(value)
    if whole and whole.group(2):
        return variables[whole.group(2)]
    return _VAR.sub(lambda m: "$" if m.group(1) == "$" else str(variables[m.group(2)]), value)


def unknown_names(value: Any, known: set[str], loc: tuple = ()) -> tuple[tuple, str] | None:
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    elif isinstance(value, str):
        for m in _VAR.finditer(value):
            if m.group(2) and m.group(2) not in known:
                return loc, m.group(2)
        return None
    else:
        return None
    for k, v in items:
        found = unknown_names(v, known, loc + (k,))
        if found:
            return found
    return None


@dataclass
class Variant:
    """One combination of a plugin's params, with every step's strings substituted."""

    params: dict[str, Any]
    applies_if: list[Check]
    apply: list[Step]
    verify: list[Check]
    rollback: list[UndoStep]

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.params.items())


@dataclass
class Plugin:
    manifest: Manifest
    folder: Path
    variants: list[Variant] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.manifest.id

    @property
    def source(self) -> Path:
        return self.folder / MANIFEST


def confine(root: Path, rel: str, source: Path | str | None = None, fld: str | None = None) -> Path:
    """The absolute path of the file `rel` inside `root`; absolute paths, `..`, a folder's name (`.`, `a/`) and
    escaping symlinks are refused."""
    p = Path(rel)
    if not rel or p.is_absolute():
        raise ConfigError(source, fld, f"path {rel!r} must be relative to the target root")
    if ".." in p.parts:
        raise ConfigError(source, fld, f"path {rel!r} must not contain '..'")
    if rel.rsplit("/", 1)[-1] in ("", "."):  # Path() would quietly read `.` as the root, `a.py/` as `a.py`
        raise ConfigError(source, fld, f"path {rel!r} names a folder; name a file (without a trailing / or .)")
    root = root.resolve()
    full = (root / p).resolve()
    if full != root and not full.is_relative_to(root):
        raise ConfigError(source, fld, f"path {rel!r} leaves {root} through a symlink")
    return root / p


def _paths(action: _Action) -> list[tuple[str, str]]:
    body, kind = action.body, action.kind
    if kind in ("replace", "yaml_set", "contains", "yaml_has"):
        return [(f"{kind}.path", body.path)]
    if kind == "deploy":
        return [("deploy.dest", body.dest)]
    return []


def load_plugin(folder: Path, roots: dict[str, Path], target_vars: dict[str, str], kind: str | None = None) -> Plugin:
    """Load and validate one plugin folder against the target's roots and variables.

    With `kind`, roots and paths are checked only for actions that run on that target kind: a step
    (or a plugin) for another kind may name a root this target does not have.
    """
    source = folder / MANIFEST
    data, tree = read_yaml(source)
    if not isinstance(data, dict):
        raise ConfigError(source, None, "expected a mapping at the top level")
    manifest = validate(Manifest, data, source, tree)
    names = set(manifest.params) | set(target_vars)
    for section in SECTIONS:
        bad = unknown_names(data.get(section) or [], names, (section,))
        if bad:
            loc, name = bad
            raise ConfigError(source, dotted(loc), f"unknown variable ${{{name}}} (known: {', '.join(sorted(names)) or 'none'})",
                              line_of(tree, loc))
    plugin = Plugin(manifest, folder.resolve())
    keys = list(manifest.params)
    for combo in itertools.product(*(manifest.params[k] for k in keys)):
        params = dict(zip(keys, combo))
        variables = {**target_vars, **params}
        sections = {}
        for section, model in (("applies_if", Check), ("apply", Step), ("verify", Check), ("rollback", UndoStep)):
            raw = substitute(data.get(section) or [], variables)
            sections[section] = [validate(model, item, source, tree, prefix=(section, i)) for i, item in enumerate(raw)]
            for i, action in enumerate(sections[section]):
                if kind is not None and (kind not in manifest.targets or not action.runs_on(kind)):
                    continue
                _check_action(action, roots, source, (section, i), tree, plugin.folder)
        plugin.variants.append(Variant(params, **sections))
    return plugin


def _check_action(action: _Action, roots: dict[str, Path], source: Path, loc: tuple, tree: Any, folder: Path) -> None:
    if action.root is not None and action.root not in roots:
        raise ConfigError(source, dotted(loc + ("root",)), f"unknown root {action.root!r} (known: {', '.join(roots)})",
                          line_of(tree, loc))
    root = roots[action.root] if action.root else next(iter(roots.values()))
    for fld, rel in _paths(action):
        confine(root, rel, source, dotted(loc + tuple(fld.split("."))))
    if action.kind == "python" and not (folder / "hooks.py").is_file():
        raise ConfigError(source, dotted(loc + ("python", "function")), f"needs {folder / 'hooks.py'}, which does not exist",
                          line_of(tree, loc))
    if action.kind == "deploy":
        src = confine(folder, action.body.src, source, dotted(loc + ("deploy", "src")))
        if not src.is_file():
            raise ConfigError(source, dotted(loc + ("deploy", "src")), f"{action.body.src!r} is not a file in {folder}")


def discover(plugins_dir: Path) -> list[Path]:
    """Plugin folders (those with a plugin.yaml); a plugin.yml alone is an error rather than a plugin left out."""
    if not plugins_dir.is_dir():
        return []
    folders = sorted(p for p in plugins_dir.iterdir() if p.is_dir())
    for folder in [plugins_dir, *folders]:  # the folder given may itself be a plugin's
        check_manifest_name(folder)
    return [p for p in folders if (p / MANIFEST).is_file()]


def check_manifest_name(folder: Path) -> None:
    if not (folder / MANIFEST).is_file() and (folder / "plugin.yml").is_file():
        raise ConfigError(folder / "plugin.yml", None, f"a manifest must be named {MANIFEST}: rename it "
                          "(as it is, the plugin would be left out)")


def load_all(plugins_dir: Path, roots: dict[str, Path], target_vars: dict[str, str],
             policy: Any = None, kind: str | None = None) -> list[Plugin]:
    """Every plugin of the folder, validated (`accept:` merged into `policy`, when given) and in staging order."""
    plugins = [load_plugin(folder, roots, target_vars, kind) for folder in discover(plugins_dir)]
    for p in plugins:
        if policy is not None and p.manifest.accept is not None:
            try:
                policy.merged(p.manifest.accept)
            except ValidationError as e:
                raise ConfigError(p.source, "accept", e.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")) from None
    seen: dict[str, Plugin] = {}
    for p in plugins:
        if p.id in seen:
            raise ConfigError(p.source, "id", f"duplicate plugin id {p.id!r} (also in {seen[p.id].source})")
        seen[p.id] = p
    return order(plugins)


def order(plugins: list[Plugin]) -> list[Plugin]:
    """Topological order over `after` and `requires`, ties broken by (order, id)."""
    by_id = {p.id: p for p in plugins}
    deps = {p.id: {d for d in p.manifest.after + p.manifest.requires if d in by_id} for p in plugins}
    ready = [(p.manifest.order, p.id) for p in plugins if not deps[p.id]]
    heapq.heapify(ready)
    done: list[Plugin] = []
    while ready:
        _, pid = heapq.heappop(ready)
        done.append(by_id[pid])
        for other, d in deps.items():
            if pid in d:
                d.discard(pid)
                if not d:
                    heapq.heappush(ready, (by_id[other].manifest.order, other))
    if len(done) != len(plugins):
        stuck = sorted(p for p, d in deps.items() if d)
        raise ConfigError(by_id[stuck[0]].source, "after", f"dependency cycle among: {', '.join(stuck)}")
    return done


NUMERICS_ENV = "ORCHESTRATOR_CHANGES_NUMERICS"


def numerics_env(plugins: Iterable[Plugin]) -> dict[str, str]:
    """The probe environment for a state made of ``plugins`` (the kept ones and the candidate):
    NUMERICS_ENV names, comma-separated, those that declare ``changes_numerics``; the greedy
    correctness probe then compares by agreement instead of equality. Empty when none does."""
    ids = [p.id for p in plugins if p.manifest.changes_numerics]
    return {NUMERICS_ENV: ",".join(ids)} if ids else {}


def declared_numerics() -> list[str]:
    """In a probe: the plugins of the state it judges that declare ``changes_numerics`` (from NUMERICS_ENV)."""
    return [p for p in os.environ.get(NUMERICS_ENV, "").split(",") if p.strip()]


def schema() -> dict[str, Any]:
    return Manifest.model_json_schema()
