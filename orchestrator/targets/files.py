"""A plain folder of files: the simplest target, and the one the tests and the shipped example use."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from orchestrator.loading import STRICT
from orchestrator.probes.live_server import LiveServer
from orchestrator.targets.base import Target, TargetConfig


class ServerSpec(BaseModel):
    """A server of the folder's state that probes with `server: true` talk to (ORCHESTRATOR_BASE_URL): started
    in the target root, `{host}` and `{port}` in its command filled in, healthy once GET /health answers 200."""

    model_config = STRICT
    command: list[str] = Field(min_length=1)
    startup_timeout: float = Field(60, gt=0)
    stop_timeout: float = Field(15, gt=0)
    # sequential: one server at a time, restarted when the folder changes; coresident / simultaneous: the server
    # reads all of the folder it needs at start, so a server of each state can live side by side (pairing.py)
    arms: Literal["sequential", "coresident", "simultaneous"] = "sequential"


class FilesConfig(TargetConfig):
    kind: Literal["files"] = "files"
    root: str = "target"
    copy_from: str | None = None  # a folder copied to `root` by prepare() when `root` does not exist yet
    server: ServerSpec | None = None
    gpu: bool = False  # its server and probes run on a GPU: each screening worker takes one


class FilesTarget(Target):
    kind = "files"
    Config = FilesConfig

    @property
    def roots(self) -> dict[str, Path]:
        return {"target": self.resolve(self.config.root)}

    def moved(self, roots: dict[str, Path]) -> dict:
        return {"root": str(roots["target"])} if "target" in roots else {}

    def uses_gpu(self) -> bool:
        return self.config.gpu

    def check(self) -> None:
        root = self.roots["target"]
        if root.is_dir():
            return
        if not self.config.copy_from:
            raise self.error("target.root", f"{root} is not a folder (set target.copy_from to create it)")
        src = self.resolve(self.config.copy_from)
        if not src.is_dir():
            raise self.error("target.copy_from", f"{src} is not a folder")

    def prepare(self) -> None:
        self.check()
        root = self.roots["target"]
        if root.is_dir():
            return
        src = self.resolve(self.config.copy_from)
        tmp = root.with_name(root.name + ".orch-tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("__pycache__"))
        tmp.rename(root)

    def has_server(self) -> bool:
        return self.config.server is not None

    def live_server(self, env: dict[str, str] | None = None, label: str = "server",
                    beside: str | None = None, aside: bool = False, arm: str | None = None) -> LiveServer | None:
        spec = self.config.server
        if spec is None:
            return None
        argv = list(spec.command)
        if argv[0] in ("python", "python3"):  # as in probe commands: the orchestrator's own interpreter
            argv[0] = sys.executable
        return LiveServer(argv, env=env, cwd=self.roots["target"], stop_timeout=spec.stop_timeout,
                          log_dir=self.server_logs, log_label=label)

    def pairing(self) -> str:
        return self.config.server.arms if self.config.server else "sequential"

    @property
    def startup_timeout(self) -> float:
        return self.config.server.startup_timeout if self.config.server else 60.0
