"""How a candidate is measured and judged: the `policy:` section of orchestrator.yaml, the judge's input.

Its defaults are written here once; the per-plugin `accept:` block overrides any field."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, Field, create_model, field_validator, model_validator

from orchestrator.guardrails import parse_guardrails
from orchestrator.loading import STRICT

MAX_SAMPLES = 100  # upper bound of repeats and pairs: each one is a probe run, often minutes long


class Calibrate(BaseModel):
    """An A/A test taken when no calibration of this environment is recorded: `starts` fresh candidate servers of
    one state, `pairs` pairs each against the kept state's server (orchestrator/calibrate.py). `at: start`: of the
    state the run starts from, before anything is staged. `at: first_keep`: of the first state the run keeps,
    before the first plugin judged against it (decisions against the baseline are judged without one), for a
    baseline unlike the states that follow it (the seed's runs one sequence at a time: its noise says nothing of
    a state that runs 256)."""

    model_config = STRICT
    starts: int = Field(4, ge=3, le=50)
    pairs: int = Field(2, ge=2, le=20)
    at: Literal["start", "first_keep"] = "start"


class Policy(BaseModel):
    model_config = STRICT
    repeats: int = Field(3, ge=1)  # baseline samples of the run; samples per arm for rule: first
    min_gain: float = Field(0.02, ge=0)
    interleave: bool = True  # pairs (B A, A B, ...) rather than the kept state's samples reused
    min_pairs: int = Field(3, ge=1)
    max_pairs: int = Field(8, ge=1)
    confidence: float = Field(0.95, gt=0, lt=1)
    rule: Literal["stat", "first"] = "stat"
    on_inconclusive: Literal["rollback", "keep"] = "rollback"
    implausible_factor: float = Field(3.0, gt=1)
    guardrails: dict[str, str] = Field(default_factory=dict)
    # Server starts: a decision's pairs come in blocks, each on fresh servers of both arms. `pairs_per_start`
    # pairs a block (None: as the calibration plans it, else one block for the whole decision); at most
    # `max_starts` blocks a decision.
    pairs_per_start: Optional[int] = Field(None, ge=1)
    max_starts: int = Field(3, ge=1, le=MAX_SAMPLES)
    calibrate: Optional[Calibrate] = None
    # Screening (screening.py): with more than one worker, independent candidates are measured at the same time,
    # each on a Ray worker of its own, and what they find is confirmed on the target; `duet`: each candidate on two
    # workers at once, the kept state on one and the candidate on the other, swapped every pair.
    workers: int = Field(1, ge=1, le=MAX_SAMPLES)
    duet: bool = False

    @field_validator("repeats", "min_pairs", "max_pairs")
    @classmethod
    def _bounded(cls, value: int) -> int:
        if value > MAX_SAMPLES:
            raise ValueError(f"{value} is more than the limit of {MAX_SAMPLES} samples per arm: each is a probe run, "
                             "and the judge's interval narrows little after a few dozen")
        return value

    @model_validator(mode="after")
    def _pairs(self) -> "Policy":
        if self.min_pairs > self.max_pairs:
            raise ValueError(f"min_pairs ({self.min_pairs}) exceeds max_pairs ({self.max_pairs})")
        parse_guardrails(self.guardrails)
        return self

    def judging(self) -> dict:
        """The fields a decision is taken under, as the history records them with it."""
        return self.model_dump(exclude=set(RUN_WIDE))

    def merged(self, overrides: "Accept | None") -> "Policy":
        if overrides is None:
            return self
        return Policy.model_validate({**self.model_dump(), **overrides.model_dump(exclude_unset=True)})


RUN_WIDE = ("workers", "duet")  # how a run spreads its work, not how one plugin is judged

# Every policy field but the run-wide ones, optional: the per-plugin `accept:` block.
Accept = create_model(
    "Accept",
    __config__=STRICT,
    **{name: (Optional[f.annotation], None) for name, f in Policy.model_fields.items() if name not in RUN_WIDE},
)
