import os

import numpy as np
import pytest
from matplotlib.image import imread

from orchestrator import fingerprint as fp
from orchestrator import report
from orchestrator.decide import Judge
from orchestrator.policy import Policy
from orchestrator.store import Store

GREEN, RED = np.array([0.173, 0.627, 0.173]), np.array([0.839, 0.153, 0.157])  # tab:green, tab:red
ORANGE = np.array([1.0, 0.498, 0.055])  # tab:orange


def judged(baseline, candidate):
    judge = Judge(Policy())
    for n in range(1, len(baseline) + 1):
        decision = judge.decide(baseline[:n], candidate[:n], final=n == len(baseline))
        if decision is not None:
            return decision


def add_step(store, run_id, plugin, outcome, reason, baseline, candidate, *, print_=None, vetoes=()):
    step = store.new_step(run_id, plugin, "measuring", objective="score")
    for i, (b, c) in enumerate(zip(baseline, candidate)):
        for arm, value in (("baseline", b), ("candidate", c)):
            store.add_measurement(run_id=run_id, step_id=step, probe="speed", role="throughput", arm=arm, repeat=i,
                                  ok=1, value=value, metrics={"score": value}, fingerprint=print_ or fp.fingerprint())
    decision = judged(baseline, candidate)
    store.add_decision(run_id, step, "score", decision.to_dict(), list(vetoes), {"min_gain": 0.02})
    store.finish_step(step, outcome, reason, gain=decision.gain)
    return decision


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "state" / "orchestrator.db"
    store = Store(path)
    run = store.start_run("run", "orchestrator.yaml", "files")
    for i, v in enumerate((100.0, 101.0, 99.0)):
        store.add_measurement(run_id=run, step_id=None, probe="speed", role="throughput", arm="baseline", repeat=i,
                              ok=1, value=v, metrics={"score": v}, fingerprint=fp.fingerprint())
    add_step(store, run, "faster-decode", "kept", None, [100, 101, 99], [120, 121, 119.5])
    add_step(store, run, "bigger-batch", "rolled_back", "regressed", [120, 121, 119], [110, 111, 109.5],
             vetoes=["p99_ttft_ms: candidate median 130 against baseline 100 violates '<= +10%' (limit 110)"])
    add_step(store, run, "old-kernel", "kept", None, [120, 121, 119], [132, 133.5, 131],
             print_={**fp.fingerprint(), "torch": "1.0.0"})
    step = store.new_step(run, "needs-vllm", "planned")
    store.finish_step(step, "skipped", "not_applicable")
    store.finish_run(run, "finished")
    store.close()
    return path, run


def test_report_tells_the_story(db, tmp_path):
    path, run = db
    out = report.write_report(path, run, tmp_path / "reports")
    assert out == tmp_path / "reports" / f"run-{run}.md"
    text = out.read_text()
    assert text.startswith(f"# Run {run}: finished")
    assert "Kept 2, rolled back 1, skipped 1." in text
    assert f"![each decision's gain in score](run-{run}.png)" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "| kept |" in rows["faster-decode"] and "+20.2%" in rows["faster-decode"]
    assert "| rolled_back | regressed |" in rows["bigger-batch"]
    assert "| skipped | not_applicable |" in rows["needs-vllm"]
    assert "3/3" in rows["faster-decode"]
    section = text.split("## bigger-batch")[1].split("##")[0]
    assert "verdict: regressed" in section and "95% interval" in section
    assert "guardrail veto: p99_ttft_ms" in section
    assert "candidate samples: 110, 111, 109.5" in section
    assert "stale: measured under another environment (torch 1.0.0 ->" in text.split("## old-kernel")[1]
    assert "stale" not in text.split("## faster-decode")[1].split("##")[0]
    assert f"- environment: host {fp.fingerprint()['host']}, " in text


def pixels_near(image, color, tol=0.06):
    return int(np.sum(np.all(np.abs(image[..., :3] - color) < tol, axis=-1)))


def test_chart_tells_kept_from_rolled_back(db, tmp_path):
    path, run = db
    report.write_report(path, run, tmp_path)
    image = imread(tmp_path / f"run-{run}.png")
    # a forest plot read at its natural size: 800 pixels wide, a few dozen pixels a decision
    assert image.shape[1] == 800 and 150 < image.shape[0] < 400
    assert pixels_near(image, GREEN) > 20 and pixels_near(image, RED) > 20


def test_chart_without_rollbacks_has_no_red(tmp_path):
    store = Store(tmp_path / "o.db")
    run = store.start_run("run", None, "files")
    add_step(store, run, "only", "kept", None, [100, 101, 99], [120, 121, 119.5])
    store.finish_run(run, "finished")
    store.close()
    report.write_report(tmp_path / "o.db", run, tmp_path / "r")
    image = imread(tmp_path / "r" / f"run-{run}.png")
    assert pixels_near(image, GREEN) > 20 and pixels_near(image, RED) == 0
    assert "baseline: 100" in (tmp_path / "r" / f"run-{run}.md").read_text()  # from the step's own baseline arm


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_unknown_run_or_database_changes_nothing(db, tmp_path):
    path, run = db
    out = tmp_path / "reports"
    report.write_report(path, run, out)
    before = snapshot(out)
    with pytest.raises(report.ReportError, match=r"no run with id 999"):
        report.write_report(path, 999, out)
    with pytest.raises(report.ReportError, match="missing.db"):
        report.write_report(tmp_path / "missing.db", run, out)
    assert snapshot(out) == before
    with pytest.raises(report.ReportError):
        report.write_report(path, 999, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_a_failing_chart_leaves_the_folder_as_it_was(db, tmp_path, monkeypatch):
    path, run = db
    out = tmp_path / "reports"
    report.write_report(path, run, out)
    (out / f"run-{run}.md").write_text("old report")
    before = snapshot(out)

    def broken(*args):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(report, "chart", broken)
    with pytest.raises(RuntimeError):
        report.write_report(path, run, out)
    assert snapshot(out) == before
    with pytest.raises(RuntimeError):
        report.write_report(path, run, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()


def test_report_reads_while_a_run_holds_the_database(db, tmp_path):
    path, run = db
    writer = Store(path)  # a run in progress keeps its connection open
    try:
        writer.start_run("run", None, "files")
        out = report.write_report(path, run, tmp_path / "live")
        assert out.is_file() and os.path.getsize(out) > 0
    finally:
        writer.close()



def test_a_run_in_progress_shows_its_measured_step_apart(tmp_path):
    store = Store(tmp_path / "o.db")
    run = store.start_run("run", None, "files")
    add_step(store, run, "done-one", "kept", None, [100, 101, 99], [120, 121, 119.5])
    step = store.new_step(run, "deciding-now", "deciding", objective="score")
    decision = judged([120, 121, 119], [126, 127, 126.5])
    store.add_decision(run, step, "score", decision.to_dict(), [], {})
    store.close()
    out = report.write_report(tmp_path / "o.db", run, tmp_path / "r")
    text = out.read_text()
    assert text.startswith(f"# Run {run}: running") and "| deciding-now | unfinished |" in text
    image = imread(tmp_path / "r" / f"run-{run}.png")
    assert pixels_near(image, ORANGE) > 20 and pixels_near(image, RED) == 0
