"""README's "measured on the GPU engine" column is filled from a run's `status --json`, never by hand."""
from __future__ import annotations

import json

from benchmarks import readme_table

README = """# title

| plugin | on the engine | measured on the GPU engine |
|---|---|---|
| `alpha` | a | old a |
| `beta` | b | old b |
| `gamma` | c | old c |
| `delta` | d | old d |
| `untouched` | e | old e |

text | with a bar
"""


def step(plugin, outcome, reason=None, gain=None, decision=None, kind="attempt"):
    return {"plugin": plugin, "outcome": outcome, "reason": reason, "gain": gain, "decision": decision, "kind": kind}


def test_cells_come_from_the_decisions_and_other_rows_stay(tmp_path):
    status = {"run": {}, "baseline": {}, "steps": [
        step("alpha", "kept", gain=0.81, decision={"n_candidate": 3, "ci_low": 0.263, "ci_high": 1.593}),
        step("beta", "rolled_back", "inconclusive", 0.383, {"n_candidate": 5, "ci_low": -0.047, "ci_high": 1.005}),
        step("gamma", "skipped", "not_applicable"),
        step("delta", None),  # still measuring: its cell stays
        step("alpha", "kept", gain=9.0, decision={"n_candidate": 4}, kind="final"),  # not an attempt
    ]}
    (tmp_path / "status.json").write_text(json.dumps(status))
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert readme_table.main([str(tmp_path / "status.json"), "--readme", str(readme)]) == 0
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in readme.read_text().splitlines()
            if line.startswith("| `")}
    assert rows == {"`alpha`": "kept, +81.0% [+26.3%, +159.3%], 3 pairs",
                    "`beta`": "rolled back: inconclusive, +38.3% [-4.7%, +100.5%], 5 pairs",
                    "`gamma`": "skipped: not_applicable", "`delta`": "old d", "`untouched`": "old e"}
    assert readme.read_text().endswith("text | with a bar\n")


def test_another_column_and_the_unmeasured_decisions(tmp_path):
    text = README.replace("| plugin | on the engine | measured on the GPU engine |",
                          "| plugin | decided on the CPU | measured on the GPU engine |")
    status = {"run": {}, "baseline": {}, "steps": [
        step("alpha", "rolled_back", "no_gain", None, {"rule": "configuration", "n_candidate": 0}),
        step("beta", "rolled_back", "regressed"),
        {**step("delta", "rolled_back", "inconclusive"),  # the same change as an earlier candidate
         "detail": "runs what alpha ran (step 3; the configuration probes read the same), which was rolled back"},
    ]}
    (tmp_path / "status.json").write_text(json.dumps(status))
    readme = tmp_path / "README.md"
    readme.write_text(text)
    assert readme_table.main([str(tmp_path / "status.json"), "--readme", str(readme),
                              "--column", "decided on the CPU"]) == 0
    rows = {line.split("|")[1].strip(): (line.split("|")[2].strip(), line.split("|")[3].strip())
            for line in readme.read_text().splitlines() if line.startswith("| `")}
    assert rows["`alpha`"] == ("rolled back: no_gain, unmeasured: runs what the kept state runs", "old a")
    assert rows["`beta`"] == ("rolled back: regressed", "old b")
    assert rows["`delta`"] == ("rolled back: inconclusive, unmeasured: the same change as `alpha`", "old d")
    assert rows["`gamma`"] == ("c", "old c")
