"""The last kept state as the staging loop measures it: its samples, what its configuration probes read, its live
server where the pairing keeps one alive from candidate to candidate, and the candidates judged against it since
it was kept. The run loop owns it and passes it to whatever measures against it; `Deployment` owns what is kept
on disk."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.prober import Arm, Sample
from orchestrator.state_server import StateServer


def compared(read: dict[str, dict]) -> dict[str, Any]:
    """The part of the configuration probes' readings that decides whether two states run the same thing."""
    return {name: metrics.get("configuration") for name, metrics in read.items()}


@dataclass
class KeptState:
    arm: Arm  # its plugins, and its own live server where the pairing keeps one
    samples: list[Sample] | None = None  # reused as the baseline arm by `interleave: false`
    configuration: dict[str, dict] | None = None  # what each configuration probe read on it, by probe name
    # candidates measured and rolled back since it was kept: (configuration, plugin, step, reason)
    judged: list[tuple[dict[str, Any], str, int, str]] = field(default_factory=list)

    @classmethod
    def of(cls, holding: list[str]) -> "KeptState":
        return cls(Arm(list(holding)))

    @property
    def server(self) -> StateServer | None:
        return self.arm.server

    def ignored(self, read: dict[str, dict]) -> dict[str, str] | None:
        """When a candidate's configuration probes read what they read on this state: what the probes said the
        target ignores here, and why ({} when they said nothing); else None."""
        if self.configuration is None or compared(read) != compared(self.configuration):
            return None
        return {k: str(v) for m in read.values() if isinstance(m.get("ignored"), dict) for k, v in m["ignored"].items()}

    def memory_changed(self, read: dict[str, dict], keys: frozenset[str]) -> bool:
        """Whether a candidate's configuration differs from this state's in a key that sizes memory."""
        if not keys or self.configuration is None:
            return False
        mine, theirs = compared(self.configuration), compared(read)
        return any((mine.get(n) or {}).get(k) != (theirs.get(n) or {}).get(k)
                   for n in set(mine) | set(theirs) for k in keys)

    def judged_like(self, read: dict[str, dict] | None) -> tuple[str, int, str] | None:
        """(plugin, step, reason) of a candidate rolled back since the last keep whose configuration probes read
        what they read on this one: the same change, judged against the same kept state. Measuring it again
        would only give the noise a second chance to keep it."""
        if read:
            for configuration, plugin, earlier, reason in self.judged:
                if configuration == compared(read):
                    return plugin, earlier, reason
        return None

    def remember(self, read: dict[str, dict] | None, plugin: str, step_id: int, reason: str) -> None:
        """A candidate was measured and rolled back with `reason` (a verdict of the judge's)."""
        if read and reason in ("no_gain", "regressed", "inconclusive"):
            self.judged.append((compared(read), plugin, step_id, reason))

    def adopt(self, holding: list[str], samples: list[Sample], configuration: dict[str, dict] | None,
              server: StateServer | None) -> None:
        """A candidate was kept: its plugins, samples, configuration and live server are now this state's (the
        server it replaces is stopped)."""
        self.arm.holding = list(holding)
        if samples:
            self.samples = samples
        if self.configuration is not None:
            self.configuration = configuration
        if self.arm.server is not None and self.arm.server is not server:
            self.arm.server.stop()
        self.arm.server = server
        self.judged = []

    def release(self) -> None:
        """Stop its live server, if it has one; a later comparison starts another where it needs one."""
        if self.arm.server is not None:
            self.arm.server.stop()
        self.arm.server = None
