"""The `vllm serve` options an installed vLLM accepts, read from its source with `ast`, never imported
(importing vLLM initialises CUDA and takes seconds, and a patched tree must be read as it is on disk).

Options are the long names its argument parser is built with: the literal ``--name`` strings of
``add_argument`` calls in ``engine/arg_utils.py`` (EngineArgs, AsyncEngineArgs) and in the serve
entry points, plus the fields of the frontend dataclasses, whose options are added in a loop. The
``EngineArgs`` dataclass fields are read too (every serve option but the frontend's is one). For an
option taking a JSON config (``compilation-config``, ``kernel-config``) the fields of its class are its nested
keys, and the fields of a field's own config class the keys below that (``compilation-config.pass_config.X``).
Sleep mode is read too: ``--enable-sleep-mode`` and the routes that put a server to sleep and wake it
(``POST /sleep``, ``POST /wake_up``), which vLLM serves only with ``VLLM_SERVER_DEV_MODE=1``. So are the
environment variables it reads (the keys of ``environment_variables`` in ``envs.py``): some settings exist only
there (``VLLM_USE_BREAKABLE_CUDAGRAPH``), and a state sets them in the serve environment file beside its serve
config (``orchestrator.targets.serve_env``).

Plugins use the command line as a precondition and as a check:

    python -m orchestrator.targets.vllm_options has max-num-seqs async-scheduling   # exit 1 naming what is missing
    python -m orchestrator.targets.vllm_options check serve.yaml                     # every key is an option
    python -m orchestrator.targets.vllm_options has-env VLLM_USE_BREAKABLE_CUDAGRAPH  # a variable it reads
    python -m orchestrator.targets.vllm_options check-env serve-env.yaml            # every VLLM_ name is one
    python -m orchestrator.targets.vllm_options list                                 # JSON

The package is ``--package``, else ``$ORCHESTRATOR_ROOT_VLLM`` (the vllm target's root), else the
vllm this interpreter would import.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.loading import ConfigError
from orchestrator.targets.serve_env import read_serve_env

# files (relative to the package) whose argument parsers make up `vllm serve`, across versions
PARSER_FILES = ("engine/arg_utils.py", "entrypoints/openai/cli_args.py", "entrypoints/common/cli_args.py",
                "entrypoints/cli/serve.py", "entrypoints/cli/main.py")
ENGINE_ARGS = ("EngineArgs", "AsyncEngineArgs")
# options whose value is a JSON object of a config class's fields
NESTED = {"compilation-config": "CompilationConfig", "kernel-config": "KernelConfig"}
NESTED_DEPTH = 2  # option.field.field: a field whose type is itself a config class (pass_config: PassConfig)
SLEEP_OPTION = "enable-sleep-mode"
SLEEP_ROUTES = ("/sleep", "/wake_up")  # POST routes of vLLM's API server in development mode
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # the environment variable that makes it serve them


def normalize(key: str) -> str:
    """A serve-config key as vLLM's parser reads it: `--` stripped, underscores as dashes."""
    return key.strip().removeprefix("--").replace("_", "-")


@dataclass(frozen=True)
class ServeOptions:
    package: Path
    version: str | None
    options: frozenset[str]  # long option names, without "--"
    engine_fields: frozenset[str]  # EngineArgs / AsyncEngineArgs field names
    # option (or option.field) -> the fields of its config class
    nested: dict[str, frozenset[str]] = field(default_factory=dict)
    sleep_routes: bool = False  # the source serves SLEEP_ROUTES when DEV_MODE_ENV is set
    env_vars: frozenset[str] = frozenset()  # the environment variables envs.py declares

    @property
    def sleeps(self) -> bool:
        """Whether a server of this vLLM can be put to sleep and woken over HTTP."""
        return SLEEP_OPTION in self.options and self.sleep_routes

    @property
    def where(self) -> str:
        return f"vLLM {self.version or '(version unknown)'} at {self.package}"

    def missing(self, key: str) -> str | None:
        """Why ``key`` (``name`` or ``name.field`` for a nested config, either with ``=VALUE``: a value the
        option's type lists) is not a serve option here, or None when it is."""
        key, eq, value = key.partition("=")
        if (why := self._missing(key)) or not eq:
            return why
        name, _, sub = key.partition(".")
        values = literal_values(self.package, normalize(name), sub)
        if values is None:
            return f"{self.where}: cannot read the values --{key} takes from its source"
        if value not in values:
            return f"{self.where}: --{key} takes no value {value!r} (it takes {', '.join(sorted(values))})"
        return None

    def _missing(self, key: str) -> str | None:
        name, _, sub = key.partition(".")
        name = normalize(name)
        if name not in self.options:
            close = difflib.get_close_matches(name, sorted(self.options), n=3, cutoff=0.75)
            hint = f" (it has {', '.join('--' + c for c in close)})" if close else ""
            return f"{self.where} has no serve option --{name}{hint}"
        path = name
        for depth, part in enumerate(sub.split(".") if sub else []):
            fields = self.nested.get(path)
            if fields is None:  # below the option itself: a field holding a free-form mapping takes any key
                return f"{self.where}: cannot read the fields of --{path} from its source" if not depth else None
            if part not in fields:
                return f"{self.where}: --{path} has no field {part!r}"
            path = f"{path}.{part}"
        return None

    def missing_env(self, name: str) -> str | None:
        """Why the environment variable ``name`` is not one this vLLM reads, or None when it is; only ``VLLM_``
        names are vLLM's to judge (CUDA's, NCCL's and the like pass)."""
        if not name.startswith("VLLM_") or name in self.env_vars:
            return None
        if not self.env_vars:
            return f"{self.where}: cannot read the environment variables it reads from its envs.py"
        close = difflib.get_close_matches(name, sorted(self.env_vars), n=3, cutoff=0.8)
        hint = f" (it reads {', '.join(close)})" if close else ""
        return f"{self.where} reads no environment variable {name}{hint}"

    def to_json(self) -> dict:
        return {"package": str(self.package), "version": self.version, "options": sorted(self.options),
                "engine_fields": sorted(self.engine_fields),
                "nested": {k: sorted(v) for k, v in self.nested.items()}, "sleeps": self.sleeps,
                "env_vars": sorted(self.env_vars)}


class SourceError(Exception):
    """The package's source cannot be read as a vLLM package."""


def _parse(path: Path) -> ast.Module:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        raise SourceError(f"cannot parse {path}: {exc}") from None


def _class_fields(tree: ast.Module, names: tuple[str, ...] | str) -> set[str]:
    """Annotated attributes in the bodies of the classes named ``names`` (or matching the regex)."""
    return set(_annotated(tree, names))


def _annotated(tree: ast.Module, names: tuple[str, ...] | str) -> dict[str, str | None]:
    """{attribute: the name of its annotation's type (`X`, `X | None`, `Optional[X]`), else None} of the classes
    named ``names``."""
    match = (lambda n: n in names) if isinstance(names, tuple) else re.compile(names).fullmatch
    found: dict[str, str | None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and match(node.name):
            found.update({s.target.id: _type_name(s.annotation)
                          for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)})
    return found


def _type_name(annotation: ast.expr) -> str | None:
    if isinstance(annotation, ast.Name):
        return annotation.id
    if isinstance(annotation, ast.BinOp):  # X | None, X | str | None: the first named type
        return _type_name(annotation.left)
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", None) == "Optional":
        return _type_name(annotation.slice)
    return None


def literal_values(package: Path, option: str, sub: str = "") -> set[str] | None:
    """The values an option (or its nested field ``sub``) takes where its type is a ``Literal[...]`` alias of the
    package (``quantization: QuantizationMethods``, ``moe_backend: MoEBackend``); None where it cannot be read."""
    if sub:
        path, kind = option, None
        for part in sub.split("."):
            cls = NESTED.get(path) if path == option else kind
            fields = _config_class_fields(package, cls) if cls else {}
            kind, path = fields.get(part), f"{path}.{part}"
    else:
        kind = _annotated(_parse(package / PARSER_FILES[0]), ENGINE_ARGS).get(option.replace("-", "_"))
    if not kind:
        return None
    pattern = re.compile(rf"^{re.escape(kind)}\s*=\s*Literal\[", re.M)
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if pattern.search(text):
            for node in _parse(path).body:
                if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [kind]
                        and isinstance(node.value, ast.Subscript)):
                    items = node.value.slice.elts if isinstance(node.value.slice, ast.Tuple) else [node.value.slice]
                    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
    return None


def _option_literals(tree: ast.Module) -> set[str]:
    """Every ``--name`` given as a literal positional argument of an ``add_argument`` call."""
    found = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            found |= {a.value[2:] for a in node.args
                      if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")}
    return found


def version_of(package: Path) -> str | None:
    """From ``vllm/_version.py`` (setuptools-scm), else a ``vllm-X.dist-info`` beside the package."""
    path = package / "_version.py"
    if path.is_file():
        found = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", path.read_text(), re.M)
        if found:
            return found.group(1)
    infos = sorted(package.parent.glob("vllm-*.dist-info"))
    return infos[-1].name[len("vllm-"):-len(".dist-info")] if infos else None


def read(package: Path) -> ServeOptions:
    """The serve options of the vLLM package folder ``package``."""
    package = Path(package)
    arg_utils = package / PARSER_FILES[0]
    if not arg_utils.is_file():
        raise SourceError(f"{package} holds no {PARSER_FILES[0]}: not a vLLM package folder")
    options: set[str] = set()
    engine_fields: set[str] = set()
    for rel in PARSER_FILES:
        path = package / rel
        if not path.is_file():
            continue
        tree = _parse(path)
        options |= _option_literals(tree)
        if rel == PARSER_FILES[0]:
            engine_fields = _class_fields(tree, ENGINE_ARGS)
        else:  # the frontend's options are added in a loop over its dataclass's fields
            options |= {normalize(f) for f in _class_fields(tree, r".*FrontendArgs")}
    options = {normalize(o) for o in options}
    nested: dict[str, frozenset[str]] = {}
    for option, cls in NESTED.items():
        if option in options:
            _nest(package, option, cls, nested, NESTED_DEPTH)
    return ServeOptions(package, version_of(package), frozenset(options), frozenset(engine_fields), nested,
                        _serves_sleep_routes(package), _env_vars(package))


def _nest(package: Path, path: str, cls: str, nested: dict[str, frozenset[str]], depth: int) -> None:
    """The fields of config class ``cls`` as the keys under ``path``, and those of its fields typed by another
    config class under ``path.field`` (``depth`` levels in all)."""
    fields = _config_class_fields(package, cls)
    if not fields:
        return
    nested[path] = frozenset(fields)
    if depth > 1:
        for name, kind in fields.items():
            if kind and kind.endswith("Config"):
                _nest(package, f"{path}.{name}", kind, nested, depth - 1)


def _config_class_fields(package: Path, cls: str) -> dict[str, str | None]:
    candidates = [package / "config.py", *sorted((package / "config").glob("*.py"))]
    for path in candidates:
        if path.is_file() and f"class {cls}" in path.read_text(encoding="utf-8", errors="replace"):
            if fields := _annotated(_parse(path), (cls,)):
                return fields
    return {}


def _serves_sleep_routes(package: Path) -> bool:
    """Whether the API server's source routes POST /sleep and POST /wake_up, and gates them on DEV_MODE_ENV."""
    envs = package / "envs.py"
    if not envs.is_file() or DEV_MODE_ENV not in envs.read_text(encoding="utf-8", errors="replace"):
        return False
    routes: set[str] = set()
    for path in sorted((package / "entrypoints").rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if '"/wake_up"' not in text and '"/sleep"' not in text:
            continue
        for node in ast.walk(_parse(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "post"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                routes.add(node.args[0].value)
    return set(SLEEP_ROUTES) <= routes


def _env_vars(package: Path) -> frozenset[str]:
    """The string keys of ``environment_variables`` in ``envs.py`` (every variable vLLM reads through it)."""
    envs = package / "envs.py"
    if not envs.is_file():
        return frozenset()
    for node in _parse(envs).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if getattr(target, "id", None) == "environment_variables" and isinstance(node.value, ast.Dict):
            return frozenset(k.value for k in node.value.keys
                             if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return frozenset()


def config_keys(path: Path) -> list[str]:
    """The keys of a `vllm serve --config` YAML, nested ones of JSON-config options as ``name.field`` (and
    ``name.field.field``)."""
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise SourceError(f"{path}: expected a mapping of `vllm serve` options")
    keys = []
    for key, value in data.items():
        keys.append(str(key))
        if normalize(str(key)) in NESTED:
            keys += _subkeys(str(key), value, NESTED_DEPTH)
    return keys


def _subkeys(prefix: str, value, depth: int) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return []
    if not isinstance(value, dict) or depth < 1:
        return []
    keys = []
    for sub, inner in value.items():
        keys.append(f"{prefix}.{sub}")
        keys += _subkeys(f"{prefix}.{sub}", inner, depth - 1) if isinstance(inner, dict) else []
    return keys


def find_package(source: Path | str | None = None) -> Path:
    """The folder of the importable `vllm` package, found without executing it; `source`: the config to name
    when there is none."""
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    try:
        located = Path(importlib.metadata.distribution("vllm").locate_file("vllm"))
    except importlib.metadata.PackageNotFoundError:
        located = None
    if located is not None and (located / "__init__.py").is_file():
        return located
    raise ConfigError(source, "target.package", "vllm is not installed for this interpreter "
                      f"({sys.executable}); install it or give the package folder as target.package")


def default_package() -> Path:
    if root := os.environ.get("ORCHESTRATOR_ROOT_VLLM"):
        return Path(root)
    return find_package()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.targets.vllm_options",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--package", type=Path, help="the vllm package folder (default: $ORCHESTRATOR_ROOT_VLLM, "
                   "else the vllm this Python would import)")
    sub = p.add_subparsers(dest="command", required=True)
    has = sub.add_parser("has", help="exit 0 when every KEY is a serve option, else 1 saying which is not")
    has.add_argument("keys", nargs="+", metavar="KEY", help="e.g. max-num-seqs, compilation-config.cudagraph_mode, or "
                     "with =VALUE a value its type lists: quantization=fp8_per_tensor")
    check = sub.add_parser("check", help="exit 0 when every key of a serve config is a serve option")
    check.add_argument("config", type=Path)
    has_env = sub.add_parser("has-env", help="exit 0 when vLLM reads every NAME from its environment, else 1")
    has_env.add_argument("names", nargs="+", metavar="NAME", help="e.g. VLLM_USE_BREAKABLE_CUDAGRAPH")
    check_env = sub.add_parser("check-env", help="exit 0 when every VLLM_ name of a serve environment file (absent: "
                               "none) is a variable vLLM reads")
    check_env.add_argument("file", type=Path)
    sub.add_parser("list", help="print the options as JSON")
    args = p.parse_args(argv)
    env = args.command in ("has-env", "check-env")
    try:
        keys = read_serve_env(args.file) if args.command == "check-env" else None
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    try:
        options = read(args.package or default_package())
        if args.command == "list":
            print(json.dumps(options.to_json()))
            return 0
        if args.command == "check":
            keys = config_keys(args.config)
    except Exception as exc:  # noqa: BLE001 - any failure to read is a clear "no" for a precondition
        print(f"cannot read vLLM's serve options: {exc}", file=sys.stderr)
        return 1
    keys = list(keys if keys is not None else args.names if env else args.keys)
    problems = [why for key in keys if (why := (options.missing_env(key) if env else options.missing(key)))]
    for why in problems:
        print(why, file=sys.stderr)
    if not problems and env:
        read_here = ", ".join(keys) if args.command == "has-env" else f"every VLLM_ variable of {args.file}"
        print(f"{options.where} reads {read_here}")
    elif not problems:
        named = ["--" + normalize(k.partition("=")[0]) + "".join(k.partition("=")[1:]) for k in keys]
        what = "its keys are" if args.command == "check" else ", ".join(named) + " are"
        print(f"{options.where}: {what} serve options")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
