"""orchestrator.yaml as pydantic models, the staging policy, and the embedded default config."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from orchestrator.loading import STRICT, ConfigError, read_yaml, validate
from orchestrator.policy import Policy
from orchestrator.targets import Target, TargetConfig, target_class

CONFIG_NAME = "orchestrator.yaml"
OPTIMIZATIONS = Path(__file__).resolve().parents[1] / "optimizations"


class ProbeSpec(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    role: Literal["correctness", "throughput", "configuration"]
    command: list[str] = Field(min_length=1)
    timeout: float = Field(600, gt=0)
    objective: str | None = None
    # the probe talks to the target's live server (a files target's `server:`): it is run with that server's
    # address and pid in ORCHESTRATOR_BASE_URL and ORCHESTRATOR_SERVER_PID, one server start serving every
    # such probe of a state
    server: bool = False

    @model_validator(mode="after")
    def _objective(self) -> "ProbeSpec":
        if self.role == "throughput" and not self.objective:
            raise ValueError("a throughput probe needs `objective` (the JSON key to maximise)")
        return self


class Config(BaseModel):
    model_config = STRICT
    target: dict[str, Any]
    plugins: str = "plugins"
    state: str = "state"
    probes: list[ProbeSpec] | None = None
    policy: Policy = Field(default_factory=Policy)

    @field_validator("probes")
    @classmethod
    def _unique(cls, probes: list[ProbeSpec] | None) -> list[ProbeSpec] | None:
        names = [p.name for p in probes or []]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate probe names: {', '.join(sorted(dup))}")
        return probes


def parse(data: Any, source: Path | str, tree: Any = None) -> tuple[Config, TargetConfig]:
    """Validate a whole config; the `target:` section with the model of its kind."""
    if not isinstance(data, dict):
        raise ConfigError(source, None, "expected a mapping at the top level")
    config = validate(Config, data, source, tree)
    kind = config.target.get("kind")
    if not isinstance(kind, str):
        raise ConfigError(source, "target.kind", "required field is missing (files, engine or vllm)")
    return config, validate(target_class(kind, source).Config, config.target, source, tree, prefix=("target",))


class Project:
    """A validated config with its paths resolved against the config file's folder."""

    def __init__(self, config: Config, target: TargetConfig, base_dir: Path, source: Path | None):
        self.config = config
        self.base_dir = base_dir.resolve()
        self.source = source
        self.policy = config.policy
        self.state_dir = self._path(config.state)
        self.plugins_dir = self._path(config.plugins)
        self.target: Target = target_class(target.kind, source)(target, self.base_dir, self.state_dir, source)
        self._check_folders()
        self.probes = self._probes()

    def _check_folders(self) -> None:
        """The state folder must be one (or creatable), and neither it nor the plugins may lie inside a target root:
        a command step snapshots its whole root, so a rollback would rewrite the live database and blobs, or the
        plugins themselves. A root inside the state folder (the engine's workspace) is fine."""
        where = self.source or "<embedded default>"
        for folder in (self.state_dir, *self.state_dir.parents):
            if folder.exists():
                if not folder.is_dir():
                    why = "is a file" if folder == self.state_dir else f"cannot be created: {folder} is a file"
                    raise ConfigError(where, "state", f"{self.state_dir} {why}, not a folder")
                break
        try:
            roots = self.target.roots
        except ConfigError:
            return  # a target that cannot be located here fails where it is used, saying why
        for field, folder in (("state", self.state_dir), ("plugins", self.plugins_dir)):
            for name, root in roots.items():
                root = root.resolve()
                if folder.is_relative_to(root):
                    raise ConfigError(where, field, f"the {field} folder {folder} is inside the target root {root} "
                                      f"({name}): snapshots of the root would include it and a rollback would "
                                      f"rewrite it; move one of them")

    def _path(self, p: str) -> Path:
        path = Path(p).expanduser()
        return (path if path.is_absolute() else self.base_dir / path).resolve()

    def _probes(self) -> list[ProbeSpec]:
        if self.config.probes is not None:
            return self.config.probes
        specs = self.target.default_probes()
        return [validate(ProbeSpec, s, self.source, prefix=("probes", i)) for i, s in enumerate(specs)]

    @property
    def db_path(self) -> Path:
        return self.state_dir / "orchestrator.db"

    def relocated(self, roots: dict[str, Path], state_dir: Path) -> "Project":
        """This project as a screening worker runs it: the named roots in its own copies, its own history, blobs and
        temporary files in `state_dir`; probes and servers of the target read the copies."""
        moved = copy.copy(self)
        moved.state_dir = state_dir
        moved.target = self.target.relocated(roots)
        moved.probes = moved._probes()
        return moved


def load(path: Path | None = None, cwd: Path | None = None, engine: dict[str, Any] | None = None) -> Project:
    """`--config FILE`, else ./orchestrator.yaml, else the embedded default; `engine` (model, device,
    dtype, num_layers) scales the embedded default and is refused with a config of the user's own."""
    cwd = (cwd or Path.cwd()).resolve()
    engine = {k: v for k, v in (engine or {}).items() if v is not None}
    if path is None:
        candidate = cwd / CONFIG_NAME
        if not candidate.exists():
            return embedded_default(cwd, engine)
        path = candidate
    path = Path(path).resolve()
    if engine:
        flags = ", ".join("--" + k.replace("_", "-") for k in engine)
        raise ConfigError(path, None, f"{flags} apply to the embedded default only; set them under `target:` here")
    data, tree = read_yaml(path)
    return Project(*parse(data, path, tree), path.parent, path)


def embedded_default(cwd: Path, engine: dict[str, Any] | None = None) -> Project:
    """The config used without --config or ./orchestrator.yaml: the shipped optimizations staged on the
    reference engine, whose workspace lives in ./state/engine."""
    state = cwd / "state"
    engine = engine or {}
    # On a GPU each sample is 10 s of steady state, and the candidate's server and the kept state's live side by
    # side and are measured at once (pairing.py, simultaneous): an A/A calibration of the first kept state comes
    # before the first plugin judged against it (three fresh servers, two pairs each, about 50 s a block there; the
    # seed's baseline runs one sequence at a time, unlike any state after `max-num-seqs-256`), and the judge counts
    # the start effects it finds; a large effect is decided in two pairs, a change of no effect is rolled back within
    # four. `orchestrator calibrate --starts 10` measures the same spreads more closely where time allows. On a CPU a
    # serving sample varies by 10-17% (the shared cores' speed: BENCHMARKS.md), so only effects of 15% or more are
    # decided there, in up to ten simultaneous pairs; a change that runs nothing different on the machine is decided
    # unmeasured by the configuration probe.
    on_gpu = str(engine.get("device", "")).startswith("cuda")
    policy = ({"repeats": 2, "min_pairs": 2, "max_pairs": 4, "calibrate": {"starts": 3, "pairs": 2, "at": "first_keep"}} if on_gpu
              else {"min_pairs": 3, "max_pairs": 10})
    data = {
        "target": {"kind": "engine", **engine},
        "plugins": str(OPTIMIZATIONS),
        "state": str(state),
        "policy": policy,
    }
    return Project(*parse(data, "<embedded default>"), cwd, None)
