"""An installed vLLM: plugins patch its package folder and edit the `vllm serve --config` YAML, and beside it
the serve environment file (``serve-env.yaml``, orchestrator.targets.serve_env) for what vLLM reads only from its
environment.

The package is located without importing it, because importing vLLM initialises CUDA and takes
seconds; a patched file must also be read from disk, never from an already-imported module.
"""
from __future__ import annotations

import ast
import functools
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from orchestrator.loading import ConfigError
from orchestrator.probes.live_server import LiveServer
from orchestrator.probes.workload import Workload
from orchestrator.targets.base import Target, TargetConfig
from orchestrator.targets.serve_env import SERVE_ENV, read_serve_env
from orchestrator.targets.vllm_options import DEV_MODE_ENV, find_package

# vLLM's routes in development mode: level 1 moves the weights to the host's memory and drops the KV cache, so a
# woken server serves the same weights without loading them again
SLEEP_PATHS = ("/sleep?level=1", "/wake_up")


class VllmWorkload(Workload):
    """The serving benchmark's load against vLLM: the seed's, 1,000-token prompts and 200 tokens out with 128 in
    flight (the seed sweeps 128 and 256), no shared prefix (a hybrid model caches none), in steady state: every
    sample is 10 s at full concurrency after 3 s of ramp, whatever the state's speed (at the seed's baseline of
    one sequence at a time a batch would take minutes)."""

    num_prompts: int = Field(128, ge=1)
    input_len: int = Field(1000, ge=1)
    output_len: int = Field(200, ge=1)
    max_concurrency: int = Field(128, ge=1)
    shared_prefix_fraction: float = Field(0.0, ge=0, lt=1)
    duration: Optional[float] = Field(10.0, gt=0)
    ramp: float = Field(3.0, ge=0)


class VllmConfig(TargetConfig):
    kind: Literal["vllm"] = "vllm"
    package: str | None = None  # the `vllm` package folder; default: the one this interpreter would import
    serve_config: str = "serve.yaml"  # a `vllm serve --config` YAML with long option names
    env: dict[str, str] = Field(default_factory=dict)  # e.g. VLLM_USE_V1: "0" for the V0 code paths
    model: str | None = None  # overrides the config's `model:` on the `vllm serve` command line
    serve_command: list[str] = Field(default_factory=lambda: ["vllm", "serve"], min_length=1)
    serve_args: list[str] = Field(default_factory=list)  # after --config/--host/--port, e.g. [--load-format, dummy]
    served_model_name: str | None = None  # passed as --served-model-name and requested by the probes
    startup_timeout: float = Field(900, gt=0)  # seconds until GET /health answers 200
    stop_timeout: float = Field(30, gt=0)  # seconds between SIGTERM and SIGKILL of the server's group
    server_timeout: int = Field(1800, ge=1)  # seconds for the serving benchmark once the server is up
    check_timeout: int = Field(600, ge=1)  # seconds for the greedy completions and the kernel check
    correctness: Literal["auto", "exact", "agreement"] = "auto"  # auto: agreement where numerics change
    # the serving probe's number to maximise: score (weighted tokens per wall second), cpu_score (per second of the
    # server's own CPU time, which other processes on a shared CPU machine do not stretch), or score_streamed (the
    # score with each prompt counted over its streamed tokens: steady-state windows only, docs/serving.md)
    objective: Literal["score", "cpu_score", "output_throughput", "score_streamed"] = "score"
    workload: VllmWorkload = Field(default_factory=VllmWorkload)
    # auto: where the installed vLLM has sleep mode, the kept state's server lives from candidate to candidate and
    # sleeps while another is measured (pairing "sleeping"); off: one server at a time, restarted at each switch
    sleep: Literal["auto", "off"] = "auto"

    @model_validator(mode="after")
    def _streamed_needs_a_window(self) -> "VllmConfig":
        if self.objective == "score_streamed" and self.workload.duration is None:
            raise ValueError("objective score_streamed is measured over steady-state windows: set workload.duration")
        return self

    @field_validator("serve_args")
    @classmethod
    def _not_ours(cls, args: list[str]) -> list[str]:
        """The probes choose the config file, host and port of every server they start."""
        taken = [a for a in args if a.split("=")[0] in ("--config", "--host", "--port")]
        if taken:
            raise ValueError(f"{taken[0].split('=')[0]} is set by the probes; remove it from serve_args")
        return args


class VllmTarget(Target):
    kind = "vllm"
    Config = VllmConfig

    @property
    def package(self) -> Path:
        return self.resolve(self.config.package) if self.config.package else find_package(
            self.source or "<embedded default>")

    @property
    def serve_config(self) -> Path:
        return self.resolve(self.config.serve_config)

    @property
    def serve_env(self) -> Path:
        """The state's serve environment file: beside the serve config, in the root plugins edit."""
        return self.serve_config.parent / SERVE_ENV

    @property
    def roots(self) -> dict[str, Path]:
        return {"vllm": self.package, "serve": self.serve_config.parent}

    @property
    def vars(self) -> dict[str, str]:
        return {"serve_config": self.serve_config.name}

    def moved(self, roots: dict[str, Path]) -> dict:
        fields = {}
        if "vllm" in roots:  # a copy of the package folder, imported through PYTHONPATH (env)
            fields["package"] = str(roots["vllm"])
        if "serve" in roots:
            fields["serve_config"] = str(roots["serve"] / self.serve_config.name)
        return fields

    def uses_gpu(self) -> bool:
        return True

    def check(self) -> None:
        """Fails early, naming the field, when the package or the serve config is not usable."""
        package = self.package
        if not (package / "__init__.py").is_file():
            raise self.error("target.package", f"{package} is not a vllm package folder (no __init__.py)")
        if not self.serve_config.is_file():
            raise self.error("target.serve_config", f"{self.serve_config} does not exist; create a "
                              "`vllm serve --config` YAML (e.g. `model: Qwen/Qwen3-30B-A3B`)")
        if self.config.model is None and not _config_has_model(self.serve_config):
            raise self.error("target.serve_config", f"{self.serve_config} names no `model:`; "
                              "add one or set target.model")
        read_serve_env(self.serve_env)

    def env(self, serve_config: Path | None = None) -> dict[str, str]:
        """The target's ``env``, then the serve environment beside ``serve_config`` (default: the state's) as it is
        on disk now: read at every server start, as vLLM reads the serve config."""
        serve_env = Path(serve_config).parent / SERVE_ENV if serve_config else self.serve_env
        extra = {**self.config.env, **read_serve_env(serve_env)}
        if self.config.model:
            extra["ORCHESTRATOR_VLLM_MODEL"] = self.config.model
        if self.config.package:
            # a package given by path need not be the one this interpreter imports
            inherited = extra.get("PYTHONPATH") or os.environ.get("PYTHONPATH")
            extra["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.package.parent), inherited]))
        return extra

    @property
    def reference_path(self) -> Path:
        """The baseline's greedy completions, recorded by the first correctness probe of the baseline."""
        return self.state_dir / "vllm-reference.json"

    def serve_argv(self, host: str = "{host}", port: int | str = "{port}") -> list[str]:
        """``serve_command [model] --config FILE --host H --port P [--served-model-name N] serve_args``;
        by default with the ``{host}`` and ``{port}`` placeholders LiveServer fills in."""
        head = list(self.config.serve_command)
        if head[0] in ("python", "python3"):  # as in probe commands: the orchestrator's own interpreter
            head[0] = sys.executable
        if self.config.model:
            head.append(self.config.model)
        argv = head + ["--config", str(self.serve_config), "--host", host, "--port", str(port)]
        if self.config.served_model_name:
            argv += ["--served-model-name", self.config.served_model_name]
        return argv + list(self.config.serve_args)

    def has_server(self) -> bool:
        return True

    def pairing(self) -> str:
        """"sleeping" where the installed vLLM can put a server to sleep and wake it (read from its source) and
        the config allows it, else "sequential": vLLM holds most of the card, so two servers are never awake
        together."""
        return "sleeping" if self.config.sleep == "auto" and self.sleeps else "sequential"

    @functools.cached_property
    def sleeps(self) -> bool:
        from orchestrator.targets.vllm_options import SourceError, read
        try:
            return read(self.package).sleeps
        except (SourceError, ConfigError):
            return False

    def pinnable(self, roots: set[str]) -> bool:
        """The serve config is read at start; the package is not: vLLM imports some modules only when first used
        (sleep mode's own, a kernel's), so a server alive while a plugin patches the package could run code of
        two states."""
        return roots <= {"serve"}

    def sleep_paths(self) -> tuple[str, str]:
        return SLEEP_PATHS

    def live_server(self, env: dict[str, str] | None = None, label: str = "server",
                    beside: str | None = None, aside: bool = False, arm: str | None = None) -> LiveServer:
        """An unstarted server of the serve config as it is on disk now (a free port on 127.0.0.1),
        with the target's stop grace period and a log kept under the state folder. For a caller
        that wants one start to serve several probes: ``start()``, ``wait_healthy(startup_timeout)``,
        then the probes of ``probes_against(server.url)``, then ``stop()``. Beside a server it sleeps
        with (`beside` "sleeping"), sleep mode is on; where servers sleep, development mode too
        (VLLM_SERVER_DEV_MODE: the sleep routes, and the resolved config the configuration probe reads, on a
        server started one at a time as well)."""
        argv, env = self.serve_argv(), dict(env or os.environ)
        if beside == "sleeping":
            argv.append("--enable-sleep-mode")
        if beside == "sleeping" or self.pairing() == "sleeping":
            env[DEV_MODE_ENV] = "1"
        return LiveServer(argv, env=env, stop_timeout=self.config.stop_timeout, log_dir=self.server_logs,
                          log_label=label)

    def _server_source(self, base_url: str | None) -> list[str]:
        if base_url:
            return ["--base-url", base_url]
        return ["--server-cmd", shlex.join(self.serve_argv()), "--stop-timeout", f"{self.config.stop_timeout:g}",
                "--server-log-dir", str(self.server_logs)]

    def _probes(self, base_url: str | None, server_pid: int | None = None) -> list[dict[str, Any]]:
        c, w = self.config, self.config.workload
        startup = f"{c.startup_timeout:g}"
        model = ["--model", c.served_model_name] if c.served_model_name else []
        margin = c.startup_timeout + c.stop_timeout + 60  # the probe itself reports a start-up timeout
        configuration = [
            {"name": "vllm-config", "role": "configuration", "timeout": margin + 120,
             "command": ["python", "-m", "orchestrator.probes.vllm_config", *self._server_source(base_url),
                         "--startup-timeout", startup, "--serve-config", str(self.serve_config),
                         "--package", str(self.package)]},
        ] if self.pairing() == "sleeping" else []  # development mode serves the resolved config, as the sleep routes
        return [
            *configuration,
            {"name": "greedy", "role": "correctness", "timeout": margin + c.check_timeout,
             "command": ["python", "-m", "orchestrator.probes.greedy", "--reference", str(self.reference_path),
                         *self._server_source(base_url), "--startup-timeout", startup, "--mode", c.correctness,
                         *model]},
            {"name": "serving", "role": "throughput", "timeout": margin + c.server_timeout, "objective": c.objective,
             "command": ["python", "-m", "orchestrator.probes.serving", *self._server_source(base_url),
                         *(["--server-pid", str(server_pid)] if base_url and server_pid else []),
                         "--health-timeout", startup, *model, *w.argv(), "--best-of", c.objective]},
        ]

    def default_probes(self) -> list[dict[str, Any]]:
        """The kernel check of deployed shims (no server: it may need the GPU's memory), then live probes,
        each starting its own `vllm serve` of the serve config on disk: where servers sleep, the configuration
        the server resolved (orchestrator.probes.vllm_config: a candidate that resolves to the kept state's is
        not measured); greedy outputs against the baseline's, then the serving benchmark. The staging loop runs the live ones against one server
        per state instead (``probes_against``)."""
        kernels = {"name": "kernels", "role": "correctness", "timeout": self.config.check_timeout,
                   "command": ["python", "-m", "orchestrator.targets.vllm", "check-kernels"]}
        return [kernels, *self._probes(None)]

    def probes_against(self, base_url: str, server_pid: int | None = None) -> list[dict[str, Any]]:
        """The live probes aimed at a server already running at ``base_url``: one start serves the
        greedy probe and the throughput samples of a state; with the server's pid the serving probe
        also reports its CPU time (cpu_score)."""
        return self._probes(base_url, server_pid)


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
    """Correctness probe: each project kernel deployed into vLLM against its float64 reference (torch is
    imported only when there is one to check)."""
    deployed = deployed_kernels(package)
    if not deployed:
        return {"passed": True, "checked": []}
    import torch
    from kernels import check

    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = [check.run(op, variant, device, torch.bfloat16 if device == "cuda" else torch.float32,
                         small=device == "cpu") for op, variant in deployed]
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
