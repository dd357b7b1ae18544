"""The project's reference engine: plugins edit the serve config in a workspace, probes serve it.

The workspace is made from the shipped baseline serve config on first use, with the model, device
and dtype of the config applied, so that the same plugins run on a laptop (`tiny`) and on a GPU
(`qwen3.6-35b-a3b`).
"""
from __future__ import annotations

import importlib.resources
import io
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from orchestrator.loading import ConfigError
from orchestrator.probes.live_server import LiveServer, engine_server_argv
from orchestrator.probes.workload import Workload
from orchestrator.targets.base import SIDE_BY_SIDE, Target, TargetConfig


def shipped_baseline() -> Path:
    """The seed deployment's serve config, shipped inside the engine package."""
    return Path(str(importlib.resources.files("engine").joinpath("configs", "baseline.yaml")))


def cores() -> list[int] | None:
    """The cores this process may use, in order: the first is the one both servers of a simultaneous comparison
    run on while measured (with `server_cores: own`, the second the candidate's), the last the one a server
    started aside runs on until then; the probes' clients use every core but the measured servers'. None where
    affinity cannot be set or only one core is there."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return cpus if len(cpus) > 1 else None


OWN_CORES_MIN = 4  # each server a core of its own, one for the server started aside, one for the probes at least


SERVE_CONFIG = "serve.yaml"

# On two CPU cores with the `tiny` preset: a window of a few seconds in the batched arms, prompts
# long enough that the prefill kernels matter, every prompt in flight at once.
CPU_WORKLOAD = Workload(num_prompts=48, input_len=256, output_len=48, max_concurrency=48)
# On a GPU, the seed's workload: 1,000-token prompts, 200 tokens out, 128 in flight (the seed sweeps 128 and 256
# concurrent requests), no shared prefix (a hybrid model caches none); steady state, so that every sample is 10 s
# at full concurrency whatever the state's speed, its first 2 s left out.
GPU_WORKLOAD = Workload(num_prompts=128, input_len=1000, output_len=200, shared_prefix_fraction=0.0,
                        max_concurrency=128, duration=10.0, ramp=2.0)
GPU_MAX_MODEL_LEN = 16384
# The live correctness probe's prompts (greedy, one at a time): block and partition edges, and past 512 tokens.
# bf16 kernels that are right round differently and a random model has near-ties, so correct variants made 4 of
# 14 such prompts diverge early on an H200; a wrong kernel makes nearly all diverge at once: the probe fails
# beyond three quarters, and kernels.check judges each kernel against float64.
LIVE_PROMPT_LENGTHS = (1, 7, 16, 17, 33, 64, 150, 300, 601, 640, 700, 730, 777, 800)
# Each of two servers living side by side on one GPU sizes its KV cache at this, not at a share of the card:
# 16 GiB holds 800,000 tokens at 4 of the hybrid model's 40 layers, 80,000 at all 40.
CORESIDENT_KV_MEMORY = 16 << 30


# glibc's allocator on a CPU, fixed: freed memory up to 32 MiB a block is kept and reused, not unmapped and
# faulted in again. Left to adapt its thresholds, it made the kernel's page faults 5-30% of a server's CPU time,
# varying from window to window and config to config (what PyTorch's CPU guides advise jemalloc or tcmalloc
# for): in an A/A test two servers of one config differed by 13% per simultaneous pair that way, by 1.0%
# this way (the spread of the log ratio; `python -m benchmarks.cpu_noise --engine-aa`, BENCHMARKS.md).
CPU_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


class EngineTargetConfig(TargetConfig):
    kind: Literal["engine"] = "engine"
    workspace: str | None = None  # default: <state>/engine
    baseline: str | None = None  # serve config the workspace starts from; default: the shipped baseline
    model: str | None = None  # a preset (engine.model_config.PRESETS) or a config.json path
    num_layers: int | None = Field(None, ge=1)
    device: str | None = None
    dtype: str | None = None
    max_model_len: int | None = Field(None, ge=1)  # default: the baseline's on a CPU, 16,384 on a GPU
    workload: Workload | None = None  # default: CPU_WORKLOAD or GPU_WORKLOAD
    # What the serving probe maximises: `score` (weighted tokens per wall second) or `cpu_score`
    # (per second of the server's own CPU time: on a shared CPU, other processes stretch wall time
    # but not the server's CPU time). Default: cpu_score on a CPU, score on a GPU.
    objective: Literal["score", "cpu_score"] | None = None
    cpu_threads: int = Field(1, ge=1)  # torch threads of the probes' engines on a CPU: fixed, not racing
    # How a candidate's samples pair with the last kept state's (orchestrator/pairing.py). auto: simultaneous,
    # on a CPU both servers on one core, interleaved by the OS every few milliseconds, so both see the same
    # machine, where the cores' speed drifts by 10-20% within seconds; on a GPU both servers on the card, each
    # with a KV cache of `coresident_kv_memory`, and on one core, their windows taken at once, so that the host's
    # drift (a virtual machine's neighbours, a step that waits on its launches) is shared (windows one after the
    # other varied by 8-16% there). coresident: both servers alive on the card, sampled one after the other.
    arms: Literal["auto", "sequential", "coresident", "simultaneous"] = "auto"
    # The cores of simultaneous arms' servers while measured: shared (one core, so that its drift slows both
    # alike), or own (a core each, where there are OWN_CORES_MIN cores or more: an engine whose steps wait on its
    # host runs at a whole core's speed then, and the cores' drifts are no longer shared). Not yet measured
    # against each other on a GPU.
    server_cores: Literal["shared", "own"] = "shared"
    simultaneous_arms: bool | None = None  # older spelling: true is arms: simultaneous, false arms: sequential
    coresident_kv_memory: int = Field(CORESIDENT_KV_MEMORY, ge=1 << 20)
    # Side-by-side servers (coresident or simultaneous) filled once, each sample a window of its steady state
    # taken up again from a pause (orchestrator/turns.py), instead of a fill from idle per sample. Default: on a
    # GPU.
    fill_once: bool | None = None
    kernel_checks: Literal["full", "small", "none"] | None = None  # default: small on CPU, full on GPU
    # engines: the correctness probe runs engines of its own, exact against a float64 reference (needs the
    # machine to itself); live: it asks the state's live server, by agreement with the baseline server's greedy
    # outputs, plus kernels.check of what that server runs. auto: engines on a CPU, live on a GPU.
    correctness: Literal["auto", "engines", "live"] = "auto"
    correctness_timeout: float = Field(900, gt=0)
    serving_timeout: float = Field(1800, gt=0)
    startup_timeout: float = Field(300, gt=0)  # seconds until the engine server answers GET /health with 200

    @model_validator(mode="after")
    def _older_arms(self) -> "EngineTargetConfig":
        if self.simultaneous_arms is not None and self.arms == "auto":
            self.arms = "simultaneous" if self.simultaneous_arms else "sequential"
        return self


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

    def moved(self, roots: dict[str, Path]) -> dict:
        folder = roots.get("workspace") or roots.get("serve")  # both roots are the workspace
        return {"workspace": str(folder)} if folder else {}

    def uses_gpu(self) -> bool:
        return self.on_gpu()

    @property
    def reference_path(self) -> Path:
        """Greedy completions of the baseline, recorded by the first correctness probe."""
        return self.state_dir / "engine-reference.json"

    @property
    def live_reference_path(self) -> Path:
        """On a GPU: the baseline server's greedy completions, recorded by the run's first correctness probe."""
        return self.state_dir / "engine-live-reference.json"

    def _overrides(self) -> dict[str, Any]:
        max_model_len = self.config.max_model_len or (GPU_MAX_MODEL_LEN if self.on_gpu() else None)
        keys = {"model": self.config.model, "num-layers": self.config.num_layers,
                "device": self.config.device, "dtype": self.config.dtype, "max-model-len": max_model_len}
        return {k: v for k, v in keys.items() if v is not None}

    @property
    def workload(self) -> Workload:
        return self.config.workload or (GPU_WORKLOAD if self.on_gpu() else CPU_WORKLOAD)

    @property
    def objective(self) -> str:
        return self.config.objective or ("score" if self.on_gpu() else "cpu_score")

    def env(self) -> dict[str, str]:
        if self.on_gpu():
            return {}
        threads = str(self.config.cpu_threads)
        return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **CPU_ALLOCATOR}

    def check(self) -> None:
        serve = self.workspace / SERVE_CONFIG
        if serve.exists():
            self._check_matches(serve)
        else:
            self._engine_config(self._baseline(), self._overrides())

    def _baseline(self) -> Path:
        baseline = self.resolve(self.config.baseline) if self.config.baseline else shipped_baseline()
        if not baseline.is_file():
            raise self.error("target.baseline", f"cannot read {baseline}: not a file")
        return baseline

    def _engine_config(self, path: Path, overrides: dict[str, Any] | None = None) -> None:
        """The serve config at `path` (with `overrides`) as the engine reads it, or the engine's objection."""
        from engine.config import ConfigError as EngineConfigError, load_config
        try:
            load_config(path, overrides)
        except EngineConfigError as exc:
            raise self.error("target.baseline", str(exc)) from None

    def prepare(self) -> None:
        self.check()
        serve = self.workspace / SERVE_CONFIG
        if serve.exists():
            return
        self.workspace.mkdir(parents=True, exist_ok=True)
        tmp = serve.with_suffix(".yaml.tmp")
        tmp.write_text(_set_keys(self._baseline().read_text(encoding="utf-8"), self._overrides()), encoding="utf-8")
        try:  # relative paths in it now resolve against the workspace
            self._engine_config(tmp)
        except ConfigError:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(serve)

    def _check_matches(self, serve: Path) -> None:
        """A workspace made for another model or device would make every recorded number meaningless."""
        from ruamel.yaml import YAML

        current = YAML(typ="safe").load(serve.read_text(encoding="utf-8")) or {}
        differ = {k: (current.get(k), v) for k, v in self._overrides().items() if current.get(k) != v}
        if differ:
            what = ", ".join(f"{k}: {a!r} there, {b!r} asked" for k, (a, b) in differ.items())
            raise self.error("target", f"the engine workspace {self.workspace} was made for another "
                              f"setup ({what}); use another state folder (--state) or remove that one")

    def default_probes(self) -> list[dict[str, Any]]:
        """The configuration probe (what the engine would run here for this workload, engine.effective: a
        candidate that changes none of it is not measured), the correctness probe, then the serving benchmark,
        which starts `python -m engine.server` of the workspace config unless aimed at a running one
        (``probes_against``). On a CPU the correctness probe runs engines of its own, exact against a float64
        reference (it needs the machine to itself); on a GPU it talks to the state's live server, judged by
        agreement with the baseline server's greedy outputs plus kernels.check of the kernels that server runs
        (bf16 kernels round differently, and a random model has near-ties)."""
        return [self._configuration(), self._correctness(None), self._serving(None)]

    def _configuration(self) -> dict[str, Any]:
        w = self.workload
        longest = round(w.input_len * (1 + w.range_ratio)) + round(w.output_len * (1 + w.range_ratio)) + 1
        return {"name": "engine-config", "role": "configuration", "timeout": self.config.correctness_timeout,
                "command": ["python", "-m", "engine.effective", "--config", str(self.workspace / SERVE_CONFIG),
                            "--max-context", str(longest)]}

    def live_correctness(self) -> bool:
        return self.config.correctness == "live" or (self.config.correctness == "auto" and self.on_gpu())

    def _correctness(self, base_url: str | None) -> dict[str, Any]:
        checks = self.config.kernel_checks or ("full" if self.on_gpu() else "small")
        name, timeout = "engine-correct", self.config.correctness_timeout
        if not self.live_correctness():
            return {"name": name, "role": "correctness", "timeout": timeout,
                    "command": ["python", "-m", "orchestrator.probes.engine_correct",
                                "--reference", str(self.reference_path), "--kernel-checks", checks]}
        source = (["--base-url", base_url] if base_url else
                  ["--server-cmd", shlex.join(engine_server_argv(str(self.workspace / SERVE_CONFIG)))])
        check = shlex.join([sys.executable, "-m", "orchestrator.probes.engine_correct", "--reference",
                            str(self.reference_path), "--kernel-checks", checks, "--served", base_url]) if base_url else None
        return {"name": name, "role": "correctness", "timeout": timeout,
                "command": ["python", "-m", "orchestrator.probes.greedy", "--reference", str(self.live_reference_path),
                            *source, "--startup-timeout", f"{self.config.startup_timeout:g}", "--mode", "agreement",
                            "--lengths", *map(str, LIVE_PROMPT_LENGTHS), "--max-early-fraction", "0.75",
                            *(["--check-command", check] if check else [])]}

    def _serving(self, base_url: str | None, server_pid: int | None = None) -> dict[str, Any]:
        source = ["--base-url", base_url, *(["--server-pid", str(server_pid)] if server_pid else [])] if base_url else []
        return {"name": "serving", "role": "throughput", "timeout": self.config.serving_timeout,
                "objective": self.objective,
                "command": ["python", "-m", "orchestrator.probes.serving", *source,
                            "--health-timeout", f"{self.config.startup_timeout:g}", *self.workload.argv(),
                            "--best-of", self.objective]}

    def has_server(self) -> bool:
        return True

    def live_server(self, env: dict[str, str] | None = None, label: str = "server",
                    beside: str | None = None, aside: bool = False, arm: str | None = None) -> LiveServer:
        """An unstarted engine server of the workspace's serve config (a free port on 127.0.0.1), its log
        kept under the state folder (the engine reads its serve config and loads its code at start, so it
        serves that state however the workspace changes afterwards). Beside a simultaneous arm it is pinned to
        the one core both share (`aside`: to a core of its own until moved there); beside another on a GPU its
        KV cache is `coresident_kv_memory`."""
        argv = engine_server_argv(str(self.workspace / SERVE_CONFIG))
        if cpus := self.server_cpus(beside, measured=not aside, arm=arm):
            argv += ["--cpu-affinity", *map(str, sorted(cpus))]
        if beside in SIDE_BY_SIDE and self.on_gpu():
            argv += ["--kv-cache-memory", str(self.config.coresident_kv_memory)]
        return LiveServer(argv, env=env, log_dir=self.server_logs, log_label=label)

    def server_cpus(self, beside: str | None, measured: bool = True, arm: str | None = None) -> set[int] | None:
        """Both servers of a simultaneous comparison share one core while measured (the OS interleaves them finely,
        so that a core's drift slows both alike), or with `server_cores: own` the candidate's has the next; one
        started aside runs on the last core until then, so that its start, its fill and the other's correctness
        probe do not halve each other's host time."""
        if beside != "simultaneous" or (cpus := cores()) is None:
            return None
        if not measured:
            return {cpus[-1]}
        return {cpus[1]} if arm == "candidate" and self.own_cores(cpus) else {cpus[0]}

    def own_cores(self, cpus: list[int]) -> bool:
        return self.config.server_cores == "own" and len(cpus) >= OWN_CORES_MIN

    def probe_cpus(self) -> set[int] | None:
        if (cpus := cores()) is None:
            return None
        return set(cpus) - set(cpus[:2] if self.own_cores(cpus) else cpus[:1])

    def pairing(self) -> str:
        arms = self.config.arms
        if arms == "auto":  # on a GPU too: there a host-bound engine's windows one after the other varied by 8-16%
            return "simultaneous"
        return arms

    def fills_once(self) -> bool:
        if self.config.fill_once is not None:
            return self.config.fill_once and self.pairing() in SIDE_BY_SIDE
        return self.pairing() in SIDE_BY_SIDE and self.on_gpu()

    def memory_keys(self) -> frozenset[str]:
        return frozenset({"gpu-memory-utilization", "kv-cache-memory"}) if self.on_gpu() else frozenset()

    def probes_against(self, base_url: str, server_pid: int | None = None) -> list[dict[str, Any]]:
        """The probes aimed at an engine server running at ``base_url`` (with its pid: the server's CPU time, for
        cpu_score): the serving benchmark, and the correctness probe where it is live."""
        return [*([self._correctness(base_url)] if self.live_correctness() else []), self._serving(base_url, server_pid)]

    def on_gpu(self) -> bool:
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
