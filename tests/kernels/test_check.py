"""The check must fail wrong kernels, crashes and unwritten outputs, and speak the probe protocol."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import kernels
from kernels import check, inputs

ROOT = Path(__file__).resolve().parents[2]


def _decode_args():
    return inputs.paged_decode([17, 40], num_heads=4, num_kv_heads=2, head_size=16, seed=0)


def test_off_by_one_context_is_caught():
    v1 = kernels.get("paged_decode", "v1")
    err = check.check_one(lambda seq_lens, **a: v1(seq_lens=seq_lens - 1, **a),
                          kernels.get("paged_decode", "reference"), _decode_args())
    assert err > check.TOLERANCE[torch.float32]


def test_nan_output_is_an_error():
    err = check.check_one(lambda query, **a: torch.full_like(query, float("nan")),
                          kernels.get("paged_decode", "reference"), _decode_args())
    assert err != err


def test_modified_input_is_reported():
    def clobber(query, **a):
        out = kernels.get("paged_decode", "v1")(query=query, **a)
        query.zero_()
        return out
    try:
        check.check_one(clobber, kernels.get("paged_decode", "reference"), _decode_args())
    except AssertionError as exc:
        assert "query" in str(exc)
    else:
        raise AssertionError("a kernel that modifies its input passed")


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "kernels.check", *args], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])


def test_cli_passes_and_reports_worst_shape():
    rc, out = _cli("--op", "moe", "--variant", "sorted", "--small")
    assert rc == 0 and out["passed"] is True
    assert out["worst_error"] < out["tolerance"] and "tokens" in out["worst_shape"]


def test_cli_unknown_variant_is_a_clear_failure():
    rc, out = _cli("--op", "moe", "--variant", "nope")
    assert rc == 2 and out["passed"] is False and "nope" in out["error"]


def test_gdn_report_smoke_run_on_the_cpu(tmp_path):
    """The GPU report's code paths on small shapes (torch variants: the Triton ones are covered above)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "kernels.gdn_report", "--device", "cpu", "--small", "--quick",
                        "--variants", "recurrent,chunk"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert last["passed"] == {"recurrent": True, "chunk": True}
    assert "### Decode step of one layer" in p.stdout and "### Prefill of one layer" in p.stdout
    rows = json.loads((tmp_path / "gdn_report.json").read_text())["rows"]
    assert {r["table"] for r in rows} == {"correctness", "decode", "prefill"}
    assert all(r["ms"] > 0 for r in rows if r["table"] != "correctness")
