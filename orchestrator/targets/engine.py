"""The project's reference engine: plugins edit the serve config in a workspace, probes serve it.

The workspace is made from the shipped baseline serve config on first use, with the model, device
and dtype of the config applied, so that the same plugins run on a laptop (`tiny`) and on a GPU
(`qwen3.6-35b-a3b`).
"""
from __future__ import annotations

import importlib.resources
import io
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.loading import ConfigError
from orchestrator.targets.base import Target, TargetConfig

SERVER_MODULE = "engine.server"  # `python -m engine.server --config FILE --host H --port P`


def shipped_baseline() -> Path:
    """The seed deployment's serve config, shipped inside the engine package."""
    return Path(str(importlib.resources.files("engine").joinpath("configs", "baseline.yaml")))


def server_argv(config: str, host: str, port: int) -> list[str]:
    """The engine's OpenAI-compatible server serving ``config``."""
    return [sys.executable, "-m", SERVER_MODULE, "--config", config, "--host", host, "--port", str(port)]
SERVE_CONFIG = "serve.yaml"


class Workload(BaseModel):
    """The serving benchmark's load; defaults finish in seconds with the `tiny` preset on two CPU cores."""

    model_config = ConfigDict(extra="forbid")
    num_prompts: int = Field(32, ge=1)
    input_len: int = Field(128, ge=1)
    output_len: int = Field(32, ge=1)
    shared_prefix_fraction: float = Field(0.5, ge=0, lt=1)
    max_concurrency: int = Field(32, ge=1)
    seed: int = 0


class EngineTargetConfig(TargetConfig):
    kind: Literal["engine"] = "engine"
    workspace: str | None = None  # default: <state>/engine
    baseline: str | None = None  # serve config the workspace starts from; default: the shipped baseline
    model: str | None = None  # a preset (engine.model_config.PRESETS) or a config.json path
    num_layers: int | None = Field(None, ge=1)
    device: str | None = None
    dtype: str | None = None
    workload: Workload = Field(default_factory=Workload)
    kernel_checks: Literal["full", "small", "none"] | None = None  # default: small on CPU, full on GPU
    correctness_timeout: float = Field(900, gt=0)
    serving_timeout: float = Field(1800, gt=0)


class EngineTarget(Target):
    kind = "engine"
    Config = EngineTargetConfig

    @property
    def workspace(self) -> Path:
        return self.resolve(self.config.workspace) if self.config.workspace else self.state_dir / "engine"

    @property
    def roots(self) -> dict[str, Path]:
        return {"workspace": self.workspace, "serve": self.workspace}

    @property
    def vars(self) -> dict[str, str]:
        return {"serve_config": SERVE_CONFIG}

    @property
    def reference_path(self) -> Path:
        """Greedy completions of the baseline, recorded by the first correctness probe."""
        return self.state_dir / "engine-reference.json"

    def _overrides(self) -> dict[str, Any]:
        keys = {"model": self.config.model, "num-layers": self.config.num_layers,
                "device": self.config.device, "dtype": self.config.dtype}
        return {k: v for k, v in keys.items() if v is not None}

    def prepare(self) -> None:
        serve = self.workspace / SERVE_CONFIG
        if serve.exists():
            self._check_matches(serve)
            return
        baseline = self.resolve(self.config.baseline) if self.config.baseline else shipped_baseline()
        try:
            text = baseline.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(None, "target.baseline", f"cannot read {baseline}: {exc.strerror or exc}") from None
        self.workspace.mkdir(parents=True, exist_ok=True)
        tmp = serve.with_suffix(".yaml.tmp")
        tmp.write_text(_set_keys(text, self._overrides()), encoding="utf-8")
        _validate(tmp, "target.baseline")
        tmp.replace(serve)

    def _check_matches(self, serve: Path) -> None:
        """A workspace made for another model or device would make every recorded number meaningless."""
        from ruamel.yaml import YAML

        current = YAML(typ="safe").load(serve.read_text(encoding="utf-8")) or {}
        differ = {k: (current.get(k), v) for k, v in self._overrides().items() if current.get(k) != v}
        if differ:
            what = ", ".join(f"{k}: {a!r} there, {b!r} asked" for k, (a, b) in differ.items())
            raise ConfigError(None, "target", f"the engine workspace {self.workspace} was made for another "
                              f"setup ({what}); use another state folder (--state) or remove that one")

    def default_probes(self) -> list[dict[str, Any]]:
        w = self.config.workload
        checks = self.config.kernel_checks or ("full" if self._on_gpu() else "small")
        return [
            {"name": "engine-correct", "role": "correctness", "timeout": self.config.correctness_timeout,
             "command": ["python", "-m", "orchestrator.probes.engine_correct",
                         "--reference", str(self.reference_path), "--kernel-checks", checks]},
            {"name": "serving", "role": "throughput", "timeout": self.config.serving_timeout,
             "objective": "score",
             "command": ["python", "-m", "orchestrator.probes.serving",
                         "--num-prompts", str(w.num_prompts), "--input-len", str(w.input_len),
                         "--output-len", str(w.output_len),
                         "--shared-prefix-fraction", str(w.shared_prefix_fraction),
                         "--max-concurrency", str(w.max_concurrency), "--seed", str(w.seed)]},
        ]

    def _on_gpu(self) -> bool:
        device = self.config.device or "auto"
        if device.startswith("cuda"):
            return True
        if device == "cpu":
            return False
        import torch

        return torch.cuda.is_available()


def _set_keys(text: str, values: dict[str, Any]) -> str:
    """Round-trip YAML edit, so the workspace keeps the baseline's comments."""
    from ruamel.yaml import YAML

    yaml = YAML()
    data = yaml.load(text)
    for key, value in values.items():
        data[key] = value
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue()


def _validate(path: Path, field: str) -> None:
    from engine.config import ConfigError as EngineConfigError, load_config

    try:
        load_config(path)
    except EngineConfigError as exc:
        path.unlink(missing_ok=True)
        raise ConfigError(None, field, str(exc)) from None
