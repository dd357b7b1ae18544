"""Guardrails: limits on a probe's other metrics (`policy.guardrails`, `metric: '<= +10%'`) that veto a keep.

Parsed when the config loads, so that a bad expression is refused before anything runs; checked against the
samples of a decision by the staging loop (stage.py)."""
from __future__ import annotations

import operator
import re
import statistics
from dataclasses import dataclass
from typing import Any, Callable


class GuardrailError(ValueError):
    """A guardrail expression that cannot be parsed; the message names the metric."""


_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt, "==": operator.eq, "!=": operator.ne,
}
_EXPR = re.compile(r"^\s*(<=|>=|==|!=|<|>)\s*([+-])?\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(%)?\s*$")


@dataclass(frozen=True)
class Guardrail:
    """``kind`` is ``relative`` (``<= +10%``: against the baseline median scaled), ``delta`` (``<= +5``:
    against the baseline median plus a signed amount) or ``absolute`` (``<= 2048``: every candidate sample)."""
    metric: str
    op: str
    kind: str
    value: float
    text: str

    def limit(self, baseline: float | None) -> float:
        if self.kind == "absolute":
            return self.value
        assert baseline is not None
        return baseline * (1 + self.value / 100) if self.kind == "relative" else baseline + self.value


def parse_guardrail(metric: str, expression: Any) -> Guardrail:
    """Parse one ``metric: expression`` entry; call this when loading a config to reject bad ones early."""
    if not isinstance(expression, str):
        raise GuardrailError(f"guardrail {metric!r}: expression must be a string such as '<= +10%', got {expression!r}")
    match = _EXPR.match(expression)
    if not match:
        raise GuardrailError(
            f"guardrail {metric!r}: cannot parse {expression!r}; expected an operator (<=, >=, <, >, ==, !=) and a "
            "number: '<= 2048' (absolute), '<= +10%' (relative to the baseline), '>= -5' (change from the baseline)")
    op, sign, number, percent = match.groups()
    value = -float(number) if sign == "-" else float(number)
    kind = "relative" if percent else ("delta" if sign else "absolute")
    return Guardrail(metric, op, kind, value, expression.strip())


def parse_guardrails(guardrails: dict[str, Any] | None) -> list[Guardrail]:
    return [parse_guardrail(metric, expr) for metric, expr in (guardrails or {}).items()]


def _values(samples: list[dict], metric: str) -> list[float]:
    values = []
    for sample in samples:
        value = sample.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values.append(float(value))
    return values


def check_guardrails(guardrails: dict[str, str], baseline_metrics: list[dict], candidate_metrics: list[dict]) -> list[str]:
    """Return one veto message per violated guardrail; an empty list lets the judge's verdict stand.

    Relative and delta limits compare medians, which noise moves least; absolute limits are
    ceilings (memory, error counts) that every candidate sample must respect. A metric the
    probe did not report vetoes too, since an unchecked guardrail would silently pass.
    """
    vetoes = []
    for rail in parse_guardrails(guardrails):
        cand = _values(candidate_metrics, rail.metric)
        if not cand:
            vetoes.append(f"{rail.metric}: not reported by the candidate's probe (guardrail {rail.text!r})")
            continue
        if rail.kind == "absolute":
            bad = [v for v in cand if not _OPS[rail.op](v, rail.value)]
            if bad:
                vetoes.append(f"{rail.metric}: candidate sample {bad[0]:g} violates {rail.text!r}")
            continue
        base = _values(baseline_metrics, rail.metric)
        if not base:
            vetoes.append(f"{rail.metric}: not reported by the baseline's probe, cannot check {rail.text!r}")
            continue
        b_med, c_med = statistics.median(base), statistics.median(cand)
        limit = rail.limit(b_med)
        if not _OPS[rail.op](c_med, limit):
            vetoes.append(f"{rail.metric}: candidate median {c_med:g} against baseline {b_med:g} violates "
                          f"{rail.text!r} (limit {limit:g})")
    return vetoes
