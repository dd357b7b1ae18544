"""A plain folder of files: the simplest target, and the one the tests and the shipped example use."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

from orchestrator.targets.base import Target, TargetConfig


class FilesConfig(TargetConfig):
    kind: Literal["files"] = "files"
    root: str = "target"
    copy_from: str | None = None  # a folder copied to `root` by prepare() when `root` does not exist yet


class FilesTarget(Target):
    kind = "files"
    Config = FilesConfig

    @property
    def roots(self) -> dict[str, Path]:
        return {"target": self.resolve(self.config.root)}

    def prepare(self) -> None:
        root = self.roots["target"]
        if root.exists() or not self.config.copy_from:
            root.mkdir(parents=True, exist_ok=True)
            return
        src = self.resolve(self.config.copy_from)
        tmp = root.with_name(root.name + ".orch-tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("__pycache__"))
        tmp.rename(root)
