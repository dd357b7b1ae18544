"""An installed vLLM: plugins patch its package folder and edit the `vllm serve --config` YAML.

The package is located without importing it, because importing vLLM initialises CUDA and takes
seconds; a patched file must also be read from disk, never from an already-imported module.
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from orchestrator.loading import ConfigError
from orchestrator.targets.base import Target, TargetConfig


class VllmConfig(TargetConfig):
    kind: Literal["vllm"] = "vllm"
    package: str | None = None  # the `vllm` package folder; default: the one this interpreter would import
    serve_config: str = "serve.yaml"  # a `vllm serve --config` YAML with long option names
    env: dict[str, str] = Field(default_factory=dict)  # e.g. VLLM_USE_V1: "0" for the V0 code paths
    model: str | None = None  # overrides the config's `model:` on the `vllm serve` command line
    server_timeout: int = Field(1800, ge=1)  # seconds for start-up plus the benchmark
    check_timeout: int = Field(600, ge=1)  # seconds for the project's kernel check


def find_package() -> Path:
    """The folder of the importable `vllm` package, found without executing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    try:
        located = Path(importlib.metadata.distribution("vllm").locate_file("vllm"))
    except importlib.metadata.PackageNotFoundError:
        located = None
    if located is not None and (located / "__init__.py").is_file():
        return located
    raise ConfigError(None, "target.package", "vllm is not installed for this interpreter "
                      f"({sys.executable}); install it or give the package folder as target.package")


class VllmTarget(Target):
    kind = "vllm"
    Config = VllmConfig

    @property
    def package(self) -> Path:
        return self.resolve(self.config.package) if self.config.package else find_package()

    @property
    def serve_config(self) -> Path:
        return self.resolve(self.config.serve_config)

    @property
    def roots(self) -> dict[str, Path]:
        return {"vllm": self.package, "serve": self.serve_config.parent}

    @property
    def vars(self) -> dict[str, str]:
        return {"serve_config": self.serve_config.name}

    def prepare(self) -> None:
        """Fails early, naming the field, when the package or the serve config is not usable."""
        package = self.package
        if not (package / "__init__.py").is_file():
            raise ConfigError(None, "target.package", f"{package} is not a vllm package folder (no __init__.py)")
        if not self.serve_config.is_file():
            raise ConfigError(None, "target.serve_config", f"{self.serve_config} does not exist; create a "
                              "`vllm serve --config` YAML (e.g. `model: Qwen/Qwen3-30B-A3B`)")
        if self.config.model is None and not _config_has_model(self.serve_config):
            raise ConfigError(None, "target.serve_config", f"{self.serve_config} names no `model:`; "
                              "add one or set target.model")

    def env(self) -> dict[str, str]:
        extra = dict(self.config.env)
        if self.config.model:
            extra["ORCHESTRATOR_VLLM_MODEL"] = self.config.model
        if self.config.package:
            # a package given by path need not be the one this interpreter imports
            inherited = extra.get("PYTHONPATH") or os.environ.get("PYTHONPATH")
            extra["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.package.parent), inherited]))
        return extra

    def server_command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
        if self.config.model:
            cmd.append(self.config.model)
        return cmd + ["--config", str(self.serve_config), "--host", "{host}", "--port", "{port}"]

    def default_probes(self) -> list[dict[str, Any]]:
        return [
            {"name": "kernels", "role": "correctness", "timeout": self.config.check_timeout,
             "command": ["python", "-m", "orchestrator.targets.vllm", "check-kernels"]},
            {"name": "serving", "role": "throughput", "timeout": self.config.server_timeout,
             "objective": "score",
             "command": ["python", "-m", "orchestrator.probes.serving",
                         "--server-cmd", shlex.join(self.server_command())]},
        ]


def _config_has_model(path: Path) -> bool:
    from ruamel.yaml import YAML, YAMLError

    try:
        data = YAML(typ="safe").load(path.read_text(encoding="utf-8"))
    except (OSError, YAMLError) as exc:
        raise ConfigError(path, None, f"cannot read the serve config: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(path, None, "the serve config must be a mapping of `vllm serve` options")
    return bool(data.get("model"))


def deployed_kernels(package: Path) -> list[tuple[str, str]]:
    """(op, variant) of every shim a plugin deployed into the package (``OP, VARIANT = ...``)."""
    found = []
    for shim in sorted(package.rglob("_orchestrator_*.py")):
        for node in ast.parse(shim.read_text(encoding="utf-8")).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple)
                    and [getattr(t, "id", None) for t in node.targets[0].elts] == ["OP", "VARIANT"]):
                found.append(tuple(ast.literal_eval(node.value)))
    return found


def check_kernels(package: Path) -> dict[str, Any]:
    """Correctness probe: each project kernel deployed into vLLM against its float64 reference."""
    import torch
    from kernels import check

    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = [check.run(op, variant, device, torch.bfloat16 if device == "cuda" else torch.float32,
                         small=device == "cpu") for op, variant in deployed_kernels(package)]
    return {"passed": all(r["passed"] for r in results), "checked": results}


def main(argv: list[str]) -> int:
    if argv != ["check-kernels"]:
        print("usage: python -m orchestrator.targets.vllm check-kernels  (reads $ORCHESTRATOR_ROOT_VLLM)",
              file=sys.stderr)
        return 2
    package = os.environ.get("ORCHESTRATOR_ROOT_VLLM")
    result = check_kernels(Path(package) if package else find_package())
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
