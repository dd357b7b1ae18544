"""The serving benchmark's load: one type for the targets that configure it and the probe that sends it.

Two shapes. A batch (`num_prompts` requests, `max_concurrency` in flight) is `vllm bench serve`'s: the window
ends when the last request does, so its tail runs below the concurrency asked for. Steady state (`duration`)
keeps `max_concurrency` requests in flight from a seeded stream and counts only what a window of `duration`
seconds produced: the same length of window whatever a state's speed, each at the concurrency asked for.

A steady state reached from an idle server needs care. Started with `max_concurrency` requests at once, all
prefill first and all finish together, a whole request's life later: a window in between sees the prefill burst
and then decoding alone, in proportions set by the window, not by the workload (on an H200, where a slow state's
request lived 70 s, prompt tokens were four fifths of a 10 s window's score). So the first wave's output lengths
are spread evenly over 1..`output_len` (`fill`): once its prompts are prefilled, its requests end one after
the other at the rate a steady state ends them, and each is replaced by a full request of the stream, whose
prompt then runs beside the others' decoding as it would in a steady state. The window begins `ramp` seconds
after the last prompt of the first wave has its first token; on a server that queues part of the wave, once that
queue has stopped draining (it admits a prompt only as a request ends: saturated already); after `fill_limit` at
the latest.
"""
from __future__ import annotations

import math
import random
from typing import Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator


GOLDEN = (math.sqrt(5) - 1) / 2


class Workload(BaseModel):
    """A seeded synthetic load, the same on every server so that runs compare."""

    model_config = ConfigDict(extra="forbid")
    num_prompts: int = Field(32, ge=1)
    input_len: int = Field(64, ge=1)
    output_len: int = Field(16, ge=1)
    range_ratio: float = Field(0.0, ge=0, lt=1)  # lengths drawn uniformly from len × [1 - r, 1 + r]
    shared_prefix_fraction: float = Field(0.5, ge=0, lt=1)  # one prefix shared by every prompt
    token_low: int = Field(0, ge=0)
    token_high: int = Field(256, ge=1)
    request_rate: float = Field(math.inf, gt=0)  # Poisson arrivals (batch shape); inf: all at once
    max_concurrency: Optional[int] = Field(8, ge=1)
    seed: int = 0
    warmup: bool = False  # a batch shaped like the workload before every window (else only on a fresh server)
    windows: int = Field(1, ge=1, le=20)  # measured passes per sample; the best by the objective counts
    duration: Optional[float] = Field(None, gt=0)  # steady state: seconds of the measured window
    ramp: float = Field(2.0, ge=0)  # steady state: seconds between the fill's last first token and the window

    @model_validator(mode="after")
    def _shape(self) -> "Workload":
        if self.token_low >= self.token_high:
            raise ValueError("token_low must be below token_high")
        if self.duration is not None and self.max_concurrency is None:
            raise ValueError("a steady-state workload (duration) needs max_concurrency")
        return self

    @property
    def steady(self) -> bool:
        return self.duration is not None

    @property
    def concurrency(self) -> int:
        return self.max_concurrency or self.num_prompts

    def _prefix(self) -> list[int]:
        rng = np.random.default_rng(self.seed)
        return rng.integers(self.token_low, self.token_high, round(self.shared_prefix_fraction * self.input_len)).tolist()

    def _length(self, rng: np.random.Generator, mean: int) -> int:
        low, high = math.floor(mean * (1 - self.range_ratio)), math.ceil(mean * (1 + self.range_ratio))
        return max(1, int(rng.integers(low, high + 1)))

    def _one(self, rng: np.random.Generator, prefix: list[int]) -> tuple[list[int], int]:
        total = max(self._length(rng, self.input_len), len(prefix) + 1)
        own = rng.integers(self.token_low, self.token_high, total - len(prefix)).tolist()
        return prefix + own, self._length(rng, self.output_len)

    def requests(self) -> list[tuple[list[int], int]]:
        """The batch: seeded (prompt token ids, output length) pairs, each prompt starting with the shared
        prefix of ``shared_prefix_fraction × input_len`` tokens, so prefix caching matters."""
        rng = np.random.default_rng(self.seed)
        prefix = rng.integers(self.token_low, self.token_high, round(self.shared_prefix_fraction * self.input_len)).tolist()
        return [self._one(rng, prefix) for _ in range(self.num_prompts)]

    def stream(self):
        """Steady state: an endless seeded stream of (prompt, output length), the same on every server."""
        prefix = self._prefix()
        k = 0
        while True:
            yield self._one(np.random.default_rng([self.seed, k]), prefix)
            k += 1

    def fill(self) -> list[int]:
        """Steady state: the first wave's output lengths, spread evenly over 1..output_len and interleaved (a
        golden-ratio order), so that the first prompts a server admits, however few, are spread as well."""
        n = self.concurrency
        lengths = [max(1, math.ceil((i + 1) * self.output_len / n)) for i in range(n)]
        return [lengths[i] for i in sorted(range(n), key=lambda i: (i * GOLDEN) % 1.0)]

    @property
    def fill_limit(self) -> float:
        """Steady state: the longest the fill waits for the first wave to be prefilled (the probe ends it sooner
        on a server that queues part of the wave). An engine whose steps take a second prefills 128 prompts of
        1,000 tokens in 10-20 s."""
        return max(30.0, 3 * self.duration)

    def delays(self) -> list[float]:
        """Send times relative to the start: Poisson arrivals at ``request_rate``, as vLLM's."""
        if math.isinf(self.request_rate):
            return [0.0] * self.num_prompts
        rng = random.Random(self.seed)
        gaps = [rng.expovariate(self.request_rate) for _ in range(self.num_prompts)]
        return np.cumsum([0.0] + gaps[:-1]).tolist()

    def argv(self) -> list[str]:
        """The serving probe's arguments for this workload (orchestrator.probes.serving)."""
        out = ["--num-prompts", str(self.num_prompts), "--input-len", str(self.input_len),
               "--output-len", str(self.output_len), "--range-ratio", str(self.range_ratio),
               "--shared-prefix-fraction", str(self.shared_prefix_fraction),
               "--token-id-range", str(self.token_low), str(self.token_high),
               "--seed", str(self.seed), "--windows", str(self.windows)]
        if self.max_concurrency is not None:
            out += ["--max-concurrency", str(self.max_concurrency)]
        if not math.isinf(self.request_rate):
            out += ["--request-rate", str(self.request_rate)]
        if self.duration is not None:
            out += ["--duration", str(self.duration), "--ramp", str(self.ramp)]
        return out + (["--warmup"] if self.warmup else [])
