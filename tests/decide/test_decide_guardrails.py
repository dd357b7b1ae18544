import pytest

from orchestrator.guardrails import GuardrailError, check_guardrails, parse_guardrail


@pytest.mark.parametrize("expr, op, kind, value", [
    ("<= +10%", "<=", "relative", 10.0),
    (">= -5%", ">=", "relative", -5.0),
    ("<=10%", "<=", "relative", 10.0),
    ("== 0", "==", "absolute", 0.0),
    ("<= 2048", "<=", "absolute", 2048.0),
    ("< 1.5e3", "<", "absolute", 1500.0),
    (">= -5", ">=", "delta", -5.0),
    ("!= +0", "!=", "delta", 0.0),
])
def test_parse(expr, op, kind, value):
    rail = parse_guardrail("m", expr)
    assert (rail.op, rail.kind, rail.value) == (op, kind, value)


@pytest.mark.parametrize("expr", ["10%", "<= ten", "=< 5", "<= 5%%", "", "<= +", "~ 3", 10, None])
def test_bad_expressions_name_the_metric(expr):
    with pytest.raises(GuardrailError, match="p99_ttft_ms"):
        parse_guardrail("p99_ttft_ms", expr)


def test_check_raises_on_a_bad_expression_before_judging():
    with pytest.raises(GuardrailError, match="errors"):
        check_guardrails({"errors": "zero"}, [{"errors": 0}], [{"errors": 0}])


BASE = [{"score": 100, "p99_ttft_ms": 100.0, "errors": 0, "mem_mb": 1000},
        {"score": 101, "p99_ttft_ms": 104.0, "errors": 0, "mem_mb": 1010},
        {"score": 99, "p99_ttft_ms": 98.0, "errors": 0, "mem_mb": 1005}]


def test_no_guardrails_no_vetoes():
    assert check_guardrails({}, BASE, BASE) == []


def test_relative_limit_compares_medians():
    rails = {"p99_ttft_ms": "<= +10%"}
    within = [{"p99_ttft_ms": v} for v in (108.0, 109.0, 150.0)]  # one outlier, median 109 <= 110
    assert check_guardrails(rails, BASE, within) == []
    beyond = [{"p99_ttft_ms": v} for v in (111.0, 112.0, 90.0)]  # median 111 > 110
    [veto] = check_guardrails(rails, BASE, beyond)
    assert veto.startswith("p99_ttft_ms:") and "111" in veto and "limit 110" in veto


def test_relative_floor():
    assert check_guardrails({"score": ">= -5%"}, BASE, [{"score": 96}] * 3) == []
    assert len(check_guardrails({"score": ">= -5%"}, BASE, [{"score": 94}] * 3)) == 1


def test_absolute_limit_holds_for_every_sample():
    rails = {"errors": "== 0", "mem_mb": "<= 2048"}
    ok = [{"errors": 0, "mem_mb": 2000}] * 3
    assert check_guardrails(rails, BASE, ok) == []
    one_error = [{"errors": 0, "mem_mb": 100}, {"errors": 2, "mem_mb": 100}, {"errors": 0, "mem_mb": 3000}]
    vetoes = check_guardrails(rails, BASE, one_error)
    assert [v.split(":")[0] for v in vetoes] == ["errors", "mem_mb"]
    assert "2" in vetoes[0] and "3000" in vetoes[1]


def test_delta_limit():
    assert check_guardrails({"mem_mb": "<= +50"}, BASE, [{"mem_mb": 1050}]) == []
    assert len(check_guardrails({"mem_mb": "<= +50"}, BASE, [{"mem_mb": 1060}])) == 1


def test_unreported_metrics_veto():
    [veto] = check_guardrails({"p99_ttft_ms": "<= +10%"}, BASE, [{"score": 1}])
    assert "p99_ttft_ms" in veto and "candidate" in veto
    [veto] = check_guardrails({"p99_ttft_ms": "<= +10%"}, [{"score": 1}], BASE)
    assert "baseline" in veto
    assert check_guardrails({"errors": "== 0"}, [], [{"errors": 0}]) == []  # absolute needs no baseline


def test_booleans_are_not_numbers():
    [veto] = check_guardrails({"errors": "== 0"}, BASE, [{"errors": False}])
    assert "not reported" in veto
