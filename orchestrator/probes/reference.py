"""The greedy reference a correctness probe judges by: written once, atomically; read back with every field
checked; and compared with a state's completions, "exact" (every token equal) or "agreement" (few prompts diverge
early). Shared by the engine's and the live server's correctness probes."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

# the fields every reference holds, and their types; a probe names its own beside them
FIELDS = (("format", int), ("model", str), ("max_tokens", int), ("prompts", list), ("outputs", list))


class ProbeFailure(Exception):
    """Reported as ``{"passed": false, "error": ...}`` (with ``reason`` when a server was at fault)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


def write_reference(path: Path, data: dict) -> None:
    """``data`` as JSON at ``path``, whole or not at all (a temporary file, synced, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_reference(path: Path, version: int, fields: tuple[tuple[str, type], ...] = ()) -> dict:
    """The reference at ``path``; ProbeFailure naming the file and the field where it cannot be read, lacks one
    of ``FIELDS`` + ``fields``, is of another format ``version`` or holds as many completions as prompts."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProbeFailure(f"{path}: cannot read the reference: {exc}") from None
    if not isinstance(data, dict):
        raise ProbeFailure(f"{path}: the reference must be a JSON object, got {type(data).__name__}")
    for key, kind in (*FIELDS, *fields):
        if not isinstance(data.get(key), kind):
            raise ProbeFailure(f"{path}: field {key!r} is missing or not a {kind.__name__}")
    if data["format"] != version:
        raise ProbeFailure(f"{path}: field 'format' is {data['format']}, this probe reads {version}")
    if len(data["outputs"]) != len(data["prompts"]):
        raise ProbeFailure(f"{path}: field 'outputs' holds {len(data['outputs'])} completions for "
                           f"{len(data['prompts'])} prompts")
    return data


def compare(expected: list[list], got: list[list], early_tokens: int) -> dict:
    """Per prompt, the index of the first differing token (its length when equal); the fraction of
    tokens equal position by position; and the fraction of prompts differing within ``early_tokens``."""
    first = [next((i for i, (a, b) in enumerate(zip(e, g)) if a != b), min(len(e), len(g)))
             if e != g else len(e) for e, g in zip(expected, got)]
    same = sum(a == b for e, g in zip(expected, got) for a, b in zip(e, g))
    return {"exact": expected == got, "first_divergence": first,
            "identical_token_fraction": same / max(1, sum(map(len, expected))),
            "early_divergence_fraction": sum(f < early_tokens for f in first) / max(1, len(first))}
