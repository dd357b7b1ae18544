"""The live correctness probe: greedy completions of token-id prompts through /v1/completions against
the baseline's, exact or by agreement; standalone against the stand-in `vllm` (the engine server)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.probes.greedy import judge
from test_vllm_live import REPO, SERVE, left_behind, standin_env

ARGS = argparse.Namespace(reference=Path("ref.json"), early_tokens=4, max_early_fraction=0.25)


def outputs(*token_lists):
    return [{"text": " ".join(map(str, t)), "token_ids": list(t)} for t in token_lists]


def test_exact_mode_fails_on_any_difference_and_agreement_allows_late_ones():
    reference = {"model": "m", "outputs": outputs([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [1, 1, 1, 1, 1, 1],
                                                  [2, 2, 2, 2, 2, 2])}
    late = outputs([1, 2, 3, 4, 5, 0], [7, 8, 9, 10, 11, 12], [1, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2])
    assert judge(reference, "m", reference["outputs"], "exact", ARGS)["passed"]
    exact = judge(reference, "m", late, "exact", ARGS)
    assert not exact["passed"] and "1 of 4 prompts differ" in exact["error"]
    agreed = judge(reference, "m", late, "agreement", ARGS)
    assert agreed["passed"] and agreed["first_divergence"] == [5, 6, 6, 6] and agreed["mode"] == "agreement"
    early = outputs([0, 2, 3, 4, 5, 6], [7, 0, 9, 10, 11, 12], [1, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2])
    refused = judge(reference, "m", early, "agreement", ARGS)
    assert not refused["passed"] and "50% of prompts diverge" in refused["error"]


def test_text_only_servers_are_compared_by_text_and_cannot_agree():
    reference = {"model": "m", "outputs": [{"text": "a b", "token_ids": None}]}
    assert judge(reference, "m", [{"text": "a b", "token_ids": None}], "exact", ARGS)["compared"] == "text"
    assert not judge(reference, "m", [{"text": "a c", "token_ids": None}], "exact", ARGS)["passed"]
    with pytest.raises(Exception, match="agreement mode compares"):
        judge(reference, "m", [{"text": "a b", "token_ids": None}], "agreement", ARGS)
    with pytest.raises(Exception, match="recorded for model 'm', the server serves 'other'"):
        judge(reference, "other", reference["outputs"], "exact", ARGS)


@pytest.fixture
def served(tmp_path):
    (tmp_path / "serve.yaml").write_text(SERVE)
    env = standin_env(tmp_path)

    def probe(*extra: str, server: str = "", **more_env: str) -> tuple[int, dict, str]:
        argv = [sys.executable, "-m", "orchestrator.probes.greedy", "--reference", str(tmp_path / "ref.json"),
                "--server-cmd", f"vllm serve --config {tmp_path / 'serve.yaml'} --host {{host}} --port {{port}} {server}",
                "--startup-timeout", "60", "--stop-timeout", "3", *extra]
        proc = subprocess.run(argv, env={**env, **more_env}, cwd=REPO, capture_output=True, text=True, timeout=300)
        return proc.returncode, json.loads(proc.stdout.splitlines()[-1]), proc.stderr
    return probe, tmp_path


def test_recorded_on_the_baseline_then_judged(served):
    probe, folder = served
    rc, out, _ = probe("--lengths", "1", "17", "64", "--max-tokens", "8", ORCHESTRATOR_PLUGIN="baseline")
    assert rc == 0 and out["recorded"] and out["passed"] and out["server_stopped_by"] == "SIGTERM"
    reference = json.loads((folder / "ref.json").read_text())
    assert [len(p) for p in reference["prompts"]] == [1, 17, 64] and reference["model"] == "tiny"
    assert all(len(o["token_ids"]) == 8 for o in reference["outputs"])

    same = probe("--lengths", "1", "17", "64", "--max-tokens", "8", ORCHESTRATOR_PLUGIN="wider")
    assert same[0] == 0 and same[1]["mode"] == "exact" and same[1]["exact"] and not same[1]["recorded"]
    numerics = probe("--lengths", "1", "17", "64", "--max-tokens", "8", ORCHESTRATOR_PLUGIN="fp8",
                     ORCHESTRATOR_CHANGES_NUMERICS="kv-cache-fp8")
    assert numerics[0] == 0 and numerics[1]["mode"] == "agreement"
    assert numerics[1]["changes_numerics"] == ["kv-cache-fp8"]

    # other weights are wrong even by agreement (in exact mode: the end-to-end run's other-seed plugin)
    rc, out, err = probe("--lengths", "1", "17", "64", "--max-tokens", "8", server="--seed 1",
                         ORCHESTRATOR_PLUGIN="other-seed", ORCHESTRATOR_CHANGES_NUMERICS="kv-cache-fp8")
    assert rc == 1 and not out["passed"] and out["mode"] == "agreement" and out["early_divergence_fraction"] == 1.0
    assert "greedy probe: FAILED" in err.splitlines()[-1]
    changed = probe("--lengths", "2", "--max-tokens", "8", ORCHESTRATOR_PLUGIN="x")
    assert changed[0] == 1 and "recorded with other prompts" in changed[1]["error"]
    assert left_behind(str(folder)) == []


def test_a_candidate_never_records_and_starts_no_server(served):
    probe, folder = served
    rc, out, _ = probe(ORCHESTRATOR_PLUGIN="max-num-seqs-search [max_num_seqs=128]")
    assert rc == 1 and "holds no reference" in out["error"] and "recorded when the baseline is probed" in out["error"]
    assert not (folder / "ref.json").exists() and not (folder / "standin").exists()


def test_a_bad_reference_names_the_file_and_field(served):
    probe, folder = served
    (folder / "ref.json").write_text(json.dumps({"format": 1, "model": "tiny", "max_tokens": 16, "prompts": []}))
    rc, out, _ = probe()
    assert rc == 1 and out["error"] == f"{folder / 'ref.json'}: field 'outputs' is missing or not a list"


def test_the_server_failing_to_start_says_why(served):
    probe, folder = served
    rc, out, err = probe(server="--max-num-seqs 0")
    assert rc == 1 and out["reason"] == "crashed" and "exited with code 2" in out["error"]
    assert "max-num-seqs" in out["error"]  # the engine's own message, from the server log's tail
    rc, out, _ = probe(server="--no-such-option 1")
    assert rc == 1 and "unrecognized arguments: --no-such-option" in out["error"]
    rc, out, _ = probe("--startup-timeout", "3", server="--standin-stall")
    assert rc == 1 and out["reason"] == "timeout" and "within 3 s" in out["error"]
    assert left_behind(str(folder)) == []


def test_deployed_kernel_shims_are_checked(served, tmp_path):
    """A shim naming a kernel variant that does not exist fails the probe, through the target's kernel check
    (--check-command), even when outputs match."""
    probe, folder = served
    package = tmp_path / "vllm"
    package.mkdir()
    (package / "_orchestrator_broken.py").write_text('OP, VARIANT = "paged_decode", "no_such_variant"\n')
    check = f"{sys.executable} -m orchestrator.targets.vllm check-kernels"
    rc, out, _ = probe("--lengths", "3", "--max-tokens", "4", "--check-command", check,
                       ORCHESTRATOR_ROOT_VLLM=str(package))
    assert rc == 1 and out["recorded"] and "kernels.check failed" in out["error"]
    assert [(c.get("passed"), "no_such_variant" in json.dumps(c)) for c in out["kernel_checks"]] == [(False, True)]


def test_a_baseline_that_does_not_reproduce_itself_is_judged_by_agreement(served):
    """Recorded as nondeterministic (its two passes differed): exact comparison would fail the
    baseline itself, so later candidates are judged by agreement, and say so."""
    probe, folder = served
    rc, out, _ = probe("--lengths", "5", "9", "--max-tokens", "6")
    assert rc == 0 and out["deterministic"] is True
    reference = json.loads((folder / "ref.json").read_text())
    assert reference["deterministic"] is True
    reference["deterministic"] = False
    reference["outputs"][0]["token_ids"][-1] = reference["outputs"][0]["token_ids"][-1] ^ 1  # a late difference
    (folder / "ref.json").write_text(json.dumps(reference))
    rc, out, _ = probe("--lengths", "5", "9", "--max-tokens", "6", ORCHESTRATOR_PLUGIN="candidate")
    assert rc == 0 and out["mode"] == "agreement" and "differed between two passes" in out["note"]
    assert out["first_divergence"] == [5, 6]
