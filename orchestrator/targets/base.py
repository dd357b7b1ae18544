"""What every target offers the staging loop: named roots, variables, environment, default probes."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from orchestrator.loading import STRICT, ConfigError

if TYPE_CHECKING:
    from orchestrator.probes.live_server import LiveServer

SIDE_BY_SIDE = ("coresident", "simultaneous")  # pairings whose two servers are awake at once (Target.pairing)


class TargetConfig(BaseModel):
    """The `target:` section of orchestrator.yaml; each kind subclasses it with its own fields."""

    model_config = STRICT
    kind: str


class Target:
    """A deployment plugins act on. Constructing one must not touch the disk: `prepare()` does that."""

    kind: ClassVar[str]
    Config: ClassVar[type[TargetConfig]] = TargetConfig

    def __init__(self, config: TargetConfig, base_dir: Path, state_dir: Path, source: Path | None = None):
        self.config = config
        self.base_dir = Path(base_dir)
        self.state_dir = Path(state_dir)
        self.source = source  # the config file; None: the embedded default

    def error(self, field: str, message: str) -> ConfigError:
        """A bad `target:` field, naming the config file it came from."""
        return ConfigError(self.source or "<embedded default>", field, message)

    @property
    def roots(self) -> dict[str, Path]:
        """Named folders plugins may change; the first is the default."""
        raise NotImplementedError

    @property
    def vars(self) -> dict[str, str]:
        return {}

    def relocated(self, roots: dict[str, Path]) -> "Target":
        """The same target with the named roots in other folders (a screening worker's copies of them); the others
        stay where they are, and so does the state folder it reads (the baseline's reference outputs)."""
        return type(self)(self.config.model_copy(update=self.moved(roots)), self.base_dir, self.state_dir, self.source)

    def moved(self, roots: dict[str, Path]) -> dict[str, Any]:
        """The config fields that put the named roots at these folders."""
        raise NotImplementedError

    def uses_gpu(self) -> bool:
        """Whether its servers and probes run on a GPU: a screening worker then takes one (screening.py)."""
        return False

    def check(self) -> None:
        """Refuse, before anything is written (the state folder included), what `prepare()` could not do."""

    def prepare(self) -> None:
        """Create what the target needs on first use (e.g. a workspace), after `check()`."""
        self.check()

    def env(self) -> dict[str, str]:
        return {}

    def default_probes(self) -> list[dict[str, Any]]:
        """Probe specs (as in orchestrator.yaml) used when the config lists none."""
        return []

    def live_server(self, env: dict[str, str] | None = None, label: str = "server",
                    beside: str | None = None, aside: bool = False, arm: str | None = None) -> "LiveServer | None":
        """An unstarted server of the target's current state that several probes can share (see
        ``probes_against``); None when there is none to share. `beside`: it will live beside a server of another
        state, "coresident" (measured one after the other) or "simultaneous" (at the same time). `aside`: on
        ``server_cpus(beside, measured=False)`` until it is moved for its samples. `arm`: "baseline" or
        "candidate", the side it serves."""
        return None

    def server_cpus(self, beside: str | None, measured: bool = True, arm: str | None = None) -> set[int] | None:
        """The CPUs a live server beside another runs on (None: wherever the OS puts it): while its samples are
        taken (`measured`), or from its start until then, where it was started aside; `arm` as for
        ``live_server``."""
        return None

    def has_server(self) -> bool:
        """Whether ``live_server`` gives one."""
        return False

    def pairing(self) -> str:
        """How the staging loop pairs samples of two states here (orchestrator/pairing.py): "sequential" (one
        state on disk and one server at a time), "coresident" (a live server of each state, both alive for the
        whole comparison, sampled one after the other), "simultaneous" (both sampled at the same time) or
        "sleeping" (a live server of each state, one awake at a time: the other sleeps, its memory given back,
        and is woken for its own samples). The last three need servers that read their state at start, so that
        each serves its state whatever is on disk later (`pinnable`); "simultaneous" also needs a machine two
        servers share fairly."""
        return "sequential"

    def pinnable(self, roots: set[str]) -> bool:
        """Whether a live server keeps serving the state it started on while files of these roots change on disk:
        it read them all at start. Where not, a comparison whose states differ there is taken one server at a
        time, and no server of the kept state outlives the change."""
        return True

    def fills_once(self) -> bool:
        """Whether a coresident or simultaneous pair's servers are filled once and measured in turns
        (orchestrator/turns.py): their server pauses with its requests kept (`POST /pause?mode=keep`,
        `POST /resume`)."""
        return False

    def sleep_paths(self) -> tuple[str, str] | None:
        """(POST path that puts a live server to sleep, POST path that wakes it) for the "sleeping" pairing."""
        return None

    def memory_keys(self) -> frozenset[str]:
        """Keys of the configuration probe's reading that size a server's memory: a candidate that changes one is
        measured one server at a time (the fixed budgets that let two servers live side by side would hide it)."""
        return frozenset()

    def probe_cpus(self) -> set[int] | None:
        """The CPUs the probes of a simultaneous pair run on (None: wherever the OS puts them): kept off the
        core the two servers share, whose every other user would slow them unevenly."""
        return None

    def probes_against(self, base_url: str, server_pid: int | None = None) -> list[dict[str, Any]]:
        """The default probes that talk to a server, aimed at one already running at ``base_url``
        (``server_pid``: its pid, whose CPU time the serving probe reads); the staging loop runs the
        other default probes with no server alive. Empty when ``live_server`` is None."""
        return []

    @property
    def startup_timeout(self) -> float:
        """Seconds a live server may take to answer ``GET /health`` with 200."""
        return float(getattr(self.config, "startup_timeout", 300.0))

    @property
    def server_logs(self) -> Path:
        """Where live servers' logs are kept, one file per start."""
        return self.state_dir / "server-logs"

    def resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return (p if p.is_absolute() else self.base_dir / p).resolve()
