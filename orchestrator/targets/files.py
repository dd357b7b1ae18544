"""A plain folder of files: the simplest target, and the one the tests and the shipped example use."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

from orchestrator.loading import ConfigError
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
        if root.is_dir():
            return
        if not self.config.copy_from:
            raise ConfigError(None, "target.root", f"{root} is not a folder (set target.copy_from to create it)")
        src = self.resolve(self.config.copy_from)
        if not src.is_dir():
            raise ConfigError(None, "target.copy_from", f"{src} is not a folder")
        tmp = root.with_name(root.name + ".orch-tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("__pycache__"))
        tmp.rename(root)
