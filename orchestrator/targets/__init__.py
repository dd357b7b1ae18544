"""Target kinds by name, imported on first use so that a missing optional dependency only matters when used."""
from __future__ import annotations

import importlib
from pathlib import Path

from orchestrator.loading import ConfigError
from orchestrator.targets.base import Target, TargetConfig

KINDS: dict[str, str] = {
    "files": "orchestrator.targets.files:FilesTarget",
    "engine": "orchestrator.targets.engine:EngineTarget",
    "vllm": "orchestrator.targets.vllm:VllmTarget",
}


def target_class(kind: str, path: Path | str | None = None) -> type[Target]:
    if kind not in KINDS:
        raise ConfigError(path, "target.kind", f"unknown target kind {kind!r} (expected one of {', '.join(KINDS)})")
    module, _, name = KINDS[kind].partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(path, "target.kind", f"target kind {kind!r} is not available here: {e}") from None


__all__ = ["KINDS", "Target", "TargetConfig", "target_class"]
