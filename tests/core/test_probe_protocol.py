"""The probe protocol fails closed: real probe processes, judged as the staging loop judges them."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from core_project import make_project, tree
from orchestrator.probes.runner import TAIL, judge_output, run_process


def probe(tmp_path: Path, body: str, role: str = "correctness", objective: str | None = None):
    script = tmp_path / "probe.py"
    script.write_text("import json, sys\n" + textwrap.dedent(body))
    result = run_process([sys.executable, str(script)], tmp_path, {}, 30)
    return judge_output(role, objective, result, 30)


FAILS_CLOSED = {
    "false then a log line": ('print(json.dumps({"passed": False}))\nprint("done checking")', "incorrect",
                              'reported "passed": false'),
    "string false": ('print(json.dumps({"passed": "false"}))', "incorrect", '"passed" is "false", not the literal true'),
    "string true": ('print(json.dumps({"passed": "true"}))', "incorrect", '"passed" is "true"'),
    "zero": ('print(json.dumps({"passed": 0}))', "incorrect", '"passed" is 0'),
    "one": ('print(json.dumps({"passed": 1}))', "incorrect", '"passed" is 1'),
    "null": ('print(json.dumps({"passed": None}))', "incorrect", '"passed" is null'),
    "no passed key": ('print(json.dumps({"ok": True}))', "incorrect", 'no "passed" key'),
    "json on stderr only": ('print("checking")\nprint(json.dumps({"passed": True}), file=sys.stderr)', "incorrect",
                            "a JSON line on stderr does not count"),
    "empty stdout": ("pass", "incorrect", "its stdout is empty"),
    "plain text": ('print("all good")', "incorrect", "last line: 'all good'"),
    "a JSON list is not an object": ('print(json.dumps([{"passed": True}]))', "incorrect", "no line of its stdout"),
    "exit 1 with passed true": ('print(json.dumps({"passed": True}))\nsys.exit(1)', "incorrect",
                                "exited with status 1"),
    "long false line after a short true line": (
        f'print(json.dumps({{"passed": True}}))\nprint(json.dumps({{"passed": False, "log": "x" * {3 * TAIL}}}))',
        "incorrect", 'reported "passed": false'),
    "deeply nested": ('print(\'{"passed": true, "x": \' + "[" * 200000 + "]" * 200000 + "}")', "probe_failed",
                      "nested too deeply"),
    "nested past the limit": ('print(\'{"passed": true, "x": \' + "[" * 100 + "]" * 100 + "}")', "probe_failed",
                              "nested deeper than 64 levels"),
    "huge number": ('print(\'{"passed": true, "n": \' + "9" * 5000 + "}")', "probe_failed",
                    "an integer of 5000 digits"),
}


@pytest.mark.parametrize("case", FAILS_CLOSED)
def test_a_correctness_probe_fails_closed_saying_what_it_read(tmp_path, case):
    body, reason, message = FAILS_CLOSED[case]
    out = probe(tmp_path, body)
    assert not out.ok and out.reason == reason, out
    assert message in out.message and "\n" not in out.message


@pytest.mark.parametrize("body", [
    'print(json.dumps({"passed": True}))',
    'print("checking")\nprint(json.dumps({"passed": True, "message": "fine"}))\nprint("bye")\nprint("{not json}")',
    f'print(json.dumps({{"passed": True, "detail": "y" * {5 * TAIL}}}))',
    'print(json.dumps({"passed": False}))\nprint(json.dumps({"passed": True}))',
    'print(json.dumps({"passed": True, "note": "a\\u2028b\\x0cc"}, ensure_ascii=False), end="\\r\\n")',
])
def test_a_correctness_probe_passes_only_with_literal_true_on_its_last_json_line(tmp_path, body):
    out = probe(tmp_path, body)
    assert out.ok and out.reason is None, out
    assert out.metrics["passed"] is True


def test_a_long_result_line_is_read_whole_while_the_stored_tail_stays_bounded(tmp_path):
    out = probe(tmp_path, f'print(json.dumps({{"passed": True, "detail": "y" * {5 * TAIL}}}))')
    assert out.ok and len(out.metrics["detail"]) == 5 * TAIL
    assert len(out.process.stdout_tail) == TAIL


@pytest.mark.parametrize("body,ok,message", [
    ('print(json.dumps({"score": 12.5}))\nprint("server stopped")', True, "measured"),
    ('print(json.dumps({"score": 12.5, "pad": "z" * 9000}))', True, "measured"),
    ('print(json.dumps({"score": 12.5}), file=sys.stderr)', False, "a JSON line on stderr does not count"),
    ('print(\'{"score": 1e999}\')', False, "no finite number at 'score'"),
    ('print(\'{"score": 1\' + "0" * 299 + "}")', True, "measured"),
    ('print(\'{"score": 1\' + "0" * 300 + "}")', False, "an integer of 301 digits"),
    ('print(\'{"score": \' + "1" * 4400 + "}")', False, "an integer of 4400 digits"),
    ('print(json.dumps({"score": "12"}))', False, "no finite number at 'score' in its JSON result line (\"12\")"),
    ('print(json.dumps({"other": 1}))', False, "(missing)"),
])
def test_a_throughput_probe_uses_the_same_result_line(tmp_path, body, ok, message):
    out = probe(tmp_path, body, "throughput", "score")
    assert out.ok is ok and message in out.message, out
    if ok:
        assert out.value in (12.5, 1e299)
    else:
        assert out.reason == "probe_failed"


def test_a_missing_probe_executable_is_a_probe_failure_not_an_exception(tmp_path):
    result = run_process(["no-such-probe-executable", "--flag"], tmp_path, {}, 30)
    out = judge_output("correctness", None, result, 30)
    assert not out.ok and out.reason == "probe_failed"
    assert out.message == "executable not found: no-such-probe-executable"


def test_a_run_rolls_back_a_candidate_whose_probe_reports_false_before_a_log_line(tmp_path):
    """Through the CLI: before, `{"passed": false}` followed by a log line kept the candidate."""
    project = make_project(tmp_path, plugins=["speedup", "breaks-answers"])
    (project.path / "probes" / "correct.py").write_text(textwrap.dedent("""\
        import json, os, sys
        from pathlib import Path
        text = (Path(os.environ["ORCHESTRATOR_TARGET_ROOT"]) / "app.txt").read_text()
        print(json.dumps({"passed": "MODE = BROKEN" not in text}))
        print("checked", len(text), "bytes")
        if "MODE = BROKEN" in text:
            print(json.dumps({"passed": True}), file=sys.stderr)
        """))
    before = tree(project.target)
    project.cli("run", check=0)
    outcomes = project.outcomes()
    assert outcomes["breaks-answers"] == ("rolled_back", "incorrect")
    assert outcomes["speedup"] == ("kept", None)
    project.cli("rollback", "--all", check=0)
    assert tree(project.target) == before


def test_a_run_goes_on_past_a_probe_whose_json_is_too_deep_to_read(tmp_path):
    project = make_project(tmp_path, plugins=["speedup", "no-gain"])
    (project.path / "probes" / "correct.py").write_text(textwrap.dedent("""\
        import os
        if os.environ["ORCHESTRATOR_PLUGIN"] == "speedup":
            print('{"passed": true, "x": ' + "[" * 100000 + "]" * 100000 + "}")
        else:
            print('{"passed": true}')
        """))
    proc = project.cli("run")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    steps = {s["plugin"]: s for s in project.status()["steps"]}
    assert (steps["speedup"]["outcome"], steps["speedup"]["reason"]) == ("rolled_back", "probe_failed")
    assert "its JSON result line is unreadable: JSON nested too deeply to parse" in steps["speedup"]["detail"]
    assert steps["no-gain"]["reason"] == "no_gain"  # the next plugin was staged and judged
