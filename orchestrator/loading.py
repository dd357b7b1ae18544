"""YAML files to validated pydantic models, with errors that name the file, the field and the line."""
from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.events import AliasEvent, CollectionEndEvent, CollectionStartEvent, ScalarEvent

M = TypeVar("M", bound=BaseModel)
# every model of a config or manifest: unknown keys are errors, and a value is not converted ("2" is no count)
STRICT = ConfigDict(extra="forbid", strict=True)
MAX_DEPTH = 64  # levels of nesting, as in a probe's result line
MAX_ALIASED = 10_000  # values that aliases repeat, counted with the aliases inside them expanded


class ConfigError(Exception):
    """Bad config or manifest: the CLI exits 2 and nothing on disk has changed."""

    def __init__(self, path: Path | str | None, field: str | None, message: str, line: int | None = None):
        self.path, self.field, self.message, self.line = path, field, message, line
        where = str(path) if path else "<config>"
        if line is not None:
            where += f":{line}"
        super().__init__(f"{where}: {field + ': ' if field else ''}{message}")


def read_yaml(path: Path) -> tuple[Any, Any]:
    """Return (plain data, round-trip tree); the tree keeps line numbers for error messages."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(path, None, f"cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise ConfigError(path, None, f"not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start} "
                          "(save the file as UTF-8)", line) from None
    try:
        bound(text, path)
        tree = YAML(typ="rt").load(text)
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else None
        raise ConfigError(path, None, f"YAML syntax error: {e.problem or e.context}", line) from None
    except YAMLError as e:
        raise ConfigError(path, None, f"YAML error: {e}") from None
    return plain(tree), tree


def bound(text: str, path: Path) -> None:
    """Refuse, from the parser's events and before anything is built, YAML nested deeper than MAX_DEPTH (building
    it recurses once per level) or whose aliases repeat more than MAX_ALIASED values: every reader of the data
    copies an alias out, so nine levels of nine aliases in half a kilobyte would become 387 million values."""
    known: dict[str, tuple[int, int]] = {}  # anchor: (values, levels) of its node, aliases expanded
    open_: list[list] = []  # the collections open around the event: [anchor, values, levels below]
    aliased = 0
    for event in YAML(typ="rt").parse(text):
        line = event.start_mark.line + 1 if event.start_mark else None
        if isinstance(event, CollectionStartEvent):
            if len(open_) >= MAX_DEPTH:
                raise ConfigError(path, None, f"YAML nested more than {MAX_DEPTH} levels deep", line)
            open_.append([event.anchor, 1, 0])
            continue
        if isinstance(event, CollectionEndEvent):
            anchor, values, below = open_.pop()
            node = (values, below + 1)
        elif isinstance(event, ScalarEvent):
            anchor, node = event.anchor, (1, 0)
        elif isinstance(event, AliasEvent):
            anchor, node = None, known.get(event.anchor, (1, 0))
            aliased += node[0]
            if aliased > MAX_ALIASED:
                raise ConfigError(path, None, f"YAML aliases repeat more than {MAX_ALIASED} values; write the values "
                                  "out or use fewer aliases", line)
            if len(open_) + node[1] > MAX_DEPTH:
                raise ConfigError(path, None, f"YAML nested more than {MAX_DEPTH} levels deep (through alias "
                                  f"*{event.anchor})", line)
        else:
            continue
        if anchor is not None:
            known[anchor] = node
        if open_:
            open_[-1][1] += node[0]
            open_[-1][2] = max(open_[-1][2], node[1])


def plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {str(k) if not isinstance(k, (int, float, bool)) else k: plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [plain(v) for v in node]
    if isinstance(node, str):
        return str(node)
    if isinstance(node, bool) or node is None:
        return node
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    return node


def line_of(tree: Any, loc: tuple) -> int | None:
    """1-based line of the deepest node of `loc` that the round-trip tree knows."""
    line = None
    node = tree
    for key in loc:
        try:
            if isinstance(node, CommentedMap) and key in node:
                line = node.lc.key(key)[0] + 1
                node = node[key]
            elif isinstance(node, CommentedSeq) and isinstance(key, int) and key < len(node):
                line = node.lc.item(key)[0] + 1
                node = node[key]
            else:
                break
        except (KeyError, IndexError, TypeError, AttributeError):
            break
    return line


def dotted(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def validate(model: type[M], data: Any, path: Path | str | None, tree: Any = None, prefix: tuple = ()) -> M:
    """Validate and raise ConfigError for the first error, naming its field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = prefix + tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required field is missing"
        raise ConfigError(path, dotted(loc), msg, line_of(tree, loc) if tree is not None else None) from None
