"""The engine correctness probe: records the reference once, then catches a wrong kernel in
float32 (exact) and in bfloat16 (agreement threshold)."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import psutil
import pytest

from serving_support import PY, REPO, env, last_json, write_config
from engine.config import load_config
from orchestrator.probes import engine_correct

CONFIG = """\
model: tiny
device: cpu
dtype: {dtype}
kv-cache-memory: 16777216
max-model-len: 256
"""


def probe(capsys, *argv: str) -> tuple[int, dict]:
    rc = engine_correct.main(list(argv))
    return rc, last_json(capsys.readouterr().out)


def config(tmp_path, name: str, dtype: str = "float32", extra: str = "") -> str:
    return str(write_config(tmp_path / name, CONFIG.format(dtype=dtype) + extra))


@pytest.fixture(scope="module")
def fp32_reference(tmp_path_factory):
    """A reference recorded by the probe as a process, as the orchestrator runs it."""
    folder = tmp_path_factory.mktemp("fp32")
    root = write_config(folder / "workspace", CONFIG.format(dtype="float32")).parent
    ref = folder / "state" / "engine-reference.json"
    proc = subprocess.run([PY, "-m", "orchestrator.probes.engine_correct", "--reference", str(ref)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env(ORCHESTRATOR_TARGET_ROOT=str(root)))
    return proc, ref, root


def test_first_run_records_and_passes(fp32_reference):
    proc, ref, _ = fp32_reference
    out = last_json(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    assert out["passed"] is True and out["recorded"] is True and out["mode"] == "exact"
    assert set(out["passes"]) == {"as_configured", "long_decode"}
    assert all(p["exact"] and p["identical_token_fraction"] == 1.0 for p in out["passes"].values())
    checked = {(c["op"], c["variant"]) for c in out["kernel_checks"]}
    assert checked == {("paged_decode", "v1"), ("paged_decode", "v2"), ("prefix_prefill", "pregather"),
                       ("moe", "sorted"), ("rms_norm", "torch"), ("qk_norm_rope", "torch")}
    assert all(c["passed"] for c in out["kernel_checks"])
    stored = json.loads(ref.read_text())
    assert stored["dtype"] == "float32" and stored["model"] == "tiny"
    assert len(stored["outputs"]) == len(stored["prompts"]) == 14
    assert all(len(o) == stored["max_tokens"] for o in stored["outputs"])


def test_later_run_compares_without_touching_the_reference(fp32_reference, capsys):
    _, ref, root = fp32_reference
    before = ref.read_bytes()
    rc, out = probe(capsys, "--reference", str(ref), "--config", str(root / "serve.yaml"),
                    "--kernel-checks", "none")
    assert rc == 0 and out["passed"] and out["recorded"] is False
    assert ref.read_bytes() == before


def test_wrong_long_decode_kernel_fails_in_float32(fp32_reference, tmp_path, capsys, wrong_kernels):
    _, ref, _ = fp32_reference
    cand = config(tmp_path, "cand", extra="attention-decode-long: off_by_constant\n")
    rc, out = probe(capsys, "--reference", str(ref), "--config", cand, "--kernel-checks", "none")
    assert rc == 1 and out["passed"] is False
    assert out["kernels"]["attention-decode-long"] == "off_by_constant"  # it passed the self-check
    assert out["passes"]["as_configured"]["passed"]  # the default threshold never routes to it
    long_pass = out["passes"]["long_decode"]
    assert not long_pass["exact"]
    assert long_pass["first_divergence"][-6:] == [1] * 6  # every long prompt, at its first decode
    assert "long_decode: outputs differ from the reference" in out["error"]


def test_crashing_kernel_fails_with_the_engine_error(fp32_reference, tmp_path, capsys, wrong_kernels):
    _, ref, _ = fp32_reference
    cand = config(tmp_path, "cand", extra="attention-decode-long: crash\ndecode-long-threshold: 100\n")
    rc, out = probe(capsys, "--reference", str(ref), "--config", cand)
    assert rc == 1 and out["passed"] is False
    assert "as_configured: the engine failed: RuntimeError: illegal memory access" in out["error"]
    # the kernel checks it had started are stopped, not left running
    assert not [p for p in psutil.Process().children(recursive=True)
                if "kernels.check" in " ".join(p.cmdline())]


def test_bfloat16_threshold_passes_the_right_kernels_and_catches_the_wrong_one(tmp_path, capsys, wrong_kernels):
    ref = tmp_path / "ref.json"
    rc, good = probe(capsys, "--reference", str(ref), "--config", config(tmp_path, "base", "bfloat16"),
                     "--kernel-checks", "none")
    assert rc == 0 and good["mode"] == "agreement" and good["recorded"]
    assert good["passes"]["long_decode"]["early_divergence_fraction"] <= 0.25
    cand = config(tmp_path, "cand", "bfloat16", "attention-decode-long: off_by_constant\n")
    rc, bad = probe(capsys, "--reference", str(ref), "--config", cand, "--kernel-checks", "none")
    assert rc == 1 and bad["passed"] is False
    assert bad["passes"]["long_decode"]["early_divergence_fraction"] >= 6 / 14
    assert "of prompts diverge within 4 tokens (at most 25% allowed)" in bad["error"]


def test_a_plugin_that_declares_new_numerics_is_judged_by_agreement_even_in_float32(tmp_path, capsys, monkeypatch):
    """A 16-bit recurrent state (ssm-state-bf16) changes float32 greedy tokens on the CPU: exact equality fails it,
    as for an undeclared change; declared in ORCHESTRATOR_CHANGES_NUMERICS it is judged by agreement, and passes."""
    from orchestrator.plugin import NUMERICS_ENV

    hybrid = "model: tiny-hybrid\ndevice: cpu\ndtype: float32\nkv-cache-memory: 16777216\nmax-model-len: 256\n"
    ref = tmp_path / "ref.json"
    rc, _ = probe(capsys, "--reference", str(ref), "--config", str(write_config(tmp_path / "base", hybrid)),
                  "--kernel-checks", "none")
    assert rc == 0
    before = ref.read_bytes()
    cand = str(write_config(tmp_path / "cand", hybrid + "mamba-ssm-cache-dtype: bfloat16\n"))
    monkeypatch.delenv(NUMERICS_ENV, raising=False)
    rc, exact = probe(capsys, "--reference", str(ref), "--config", cand, "--kernel-checks", "none")
    assert rc == 1 and exact["mode"] == "exact" and "outputs differ from the reference" in exact["error"]
    monkeypatch.setenv(NUMERICS_ENV, "ssm-state-bf16")
    rc, agreed = probe(capsys, "--reference", str(ref), "--config", cand, "--kernel-checks", "none")
    assert agreed["mode"] == "agreement" and agreed["changes_numerics"] == ["ssm-state-bf16"]
    assert rc == 0 and agreed["passed"], agreed
    assert not all(p["exact"] for p in agreed["passes"].values())  # it did change tokens
    assert ref.read_bytes() == before


def test_reference_of_another_model_is_refused_and_kept(fp32_reference, tmp_path, capsys):
    _, ref, _ = fp32_reference
    before = ref.read_bytes()
    cand = config(tmp_path, "cand", extra="seed: 7\n")
    rc, out = probe(capsys, "--reference", str(ref), "--config", cand)
    assert rc == 1 and out == {"passed": False, "error": out["error"]}
    assert out["error"].startswith(f"{ref}: recorded for seed 0, the candidate has 7")
    assert ref.read_bytes() == before


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read the reference"),
    ("[1, 2]", "the reference must be a JSON object, got list"),
    (json.dumps({"format": 1, "prompts": [[1]], "outputs": [], "max_tokens": 2, "model": "tiny",
                 "dtype": "float32", "device": "cpu"}), "field 'outputs' holds 0 completions for 1 prompts"),
    (json.dumps({"format": 1, "prompts": [[1]], "outputs": [[2]], "max_tokens": 2, "model": "tiny"}),
     "field 'dtype' is missing or not a str"),
])
def test_corrupt_reference_names_file_and_field_and_is_kept(tmp_path, capsys, content, message):
    ref = tmp_path / "ref.json"
    ref.write_text(content)
    rc, out = probe(capsys, "--reference", str(ref), "--config", config(tmp_path, "c"))
    assert rc == 1 and out["error"].startswith(f"{ref}: {message}")
    assert ref.read_text() == content


def test_bad_config_records_nothing(tmp_path, capsys):
    ref = tmp_path / "state" / "ref.json"
    bad = config(tmp_path, "c", extra="attention-decode: warp_speed\n")
    rc, out = probe(capsys, "--reference", str(ref), "--config", bad)
    assert rc == 1 and f"{bad}: attention-decode: unknown paged_decode variant 'warp_speed'" in out["error"]
    assert not ref.exists() and not ref.parent.exists()


def test_failing_kernel_check_fails_the_probe(tmp_path):
    checks = engine_correct.KernelChecks.of(load_config(config(tmp_path, "c")), "auto")
    results = checks.run({"moe-dispatch": "sorted", "attention-decode": "no_such"})
    by_variant = {r["variant"]: r for r in results}
    assert by_variant["sorted"]["passed"] is True and by_variant["sorted"]["worst_error"] < 1e-4
    assert by_variant["no_such"]["passed"] is False
    assert "unknown variant 'no_such'" in by_variant["no_such"]["error"]


def test_at_most_one_engine_alive_and_kernel_checks_run_with_none(fp32_reference, capsys, monkeypatch):
    """On one GPU two engines each reserving most of the card cannot coexist, and a kernel check
    started beside an engine competes with its cache: the probe frees each engine before the next
    is made and starts the checks only once none is left."""
    _, ref, root = fp32_reference
    live, peak, live_at_checks = [0], [0], []

    from engine.llm import LLM

    class CountingLLM(LLM):
        def __init__(self, config):
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            super().__init__(config)

        def close(self):
            if self.engine is not None:
                live[0] -= 1
            super().close()

    real_run = engine_correct.KernelChecks.run

    def run(self, choice):
        live_at_checks.append(live[0])
        return real_run(self, choice)

    monkeypatch.setattr("engine.llm.LLM", CountingLLM)
    monkeypatch.setattr(engine_correct.KernelChecks, "run", run)
    rc, out = probe(capsys, "--reference", str(ref), "--config", str(root / "serve.yaml"),
                    "--kernel-checks", "small")
    assert rc == 0, out
    assert set(out["passes"]) == {"as_configured", "long_decode"}  # two engines were made...
    assert peak[0] == 1 and live[0] == 0  # ...one after the other, both freed
    assert live_at_checks == [0] and all(c["passed"] for c in out["kernel_checks"])


def test_close_frees_the_model(tmp_path):
    import weakref

    from engine import LLM

    llm = LLM(config(tmp_path, "close"))
    model = weakref.ref(llm.engine.model_runner.model)
    with llm:
        assert llm.generate([[1, 2, 3]], 2)
    assert llm.engine is None and model() is None


def test_passed_kernel_checks_are_remembered_per_kernel_source(tmp_path, monkeypatch):
    cache = tmp_path / "checks.json"
    cfg = load_config(config(tmp_path, "c"))
    first = engine_correct.KernelChecks.of(cfg, "auto", cache).run({"moe-dispatch": "sorted",
                                                                 "attention-decode": "no_such"})
    assert [r.get("cached", False) for r in first] == [False, False]
    stored = json.loads(cache.read_text())
    assert len(stored) == 1 and next(iter(stored)).endswith("/cpu/float32/small/moe/sorted")  # failures aren't kept
    spawned = []
    real_popen = engine_correct.subprocess.Popen
    monkeypatch.setattr(engine_correct.subprocess, "Popen", lambda argv, **kw: spawned.append(argv) or real_popen(argv, **kw))
    again = {r["variant"]: r for r in engine_correct.KernelChecks.of(cfg, "auto", cache).run(
        {"moe-dispatch": "sorted", "attention-decode": "no_such"})}
    assert again["sorted"]["cached"] is True and again["sorted"]["passed"] is True
    assert again["no_such"]["passed"] is False and len(spawned) == 1  # only the failed one ran again
    monkeypatch.setattr(engine_correct, "kernels_digest", lambda: "changed-source")
    rerun = engine_correct.KernelChecks.of(cfg, "auto", cache).run({"moe-dispatch": "sorted"})
    assert rerun[0].get("cached") is None and rerun[0]["passed"] and len(spawned) == 2


def test_compare_dtype_runs_the_prompts_in_float32_and_checks_kernels_in_the_deployments(tmp_path, capsys,
                                                                                          wrong_kernels):
    """A bfloat16 deployment judged with --compare-dtype float32 (as the engine target asks on a GPU):
    the reference is recorded in float32, the kernels are checked in bfloat16, and a wrong kernel
    still fails."""
    ref = tmp_path / "state" / "engine-reference.json"
    good = config(tmp_path, "good", dtype="bfloat16")
    rc, out = probe(capsys, "--reference", str(ref), "--config", good, "--compare-dtype", "float32",
                    "--kernel-checks", "small", "--no-check-cache")
    assert rc == 0 and out["passed"] and out["recorded"] and out["mode"] == "exact"  # float32 on the CPU
    assert json.loads(ref.read_text())["dtype"] == "float32"
    assert all(p["identical_token_fraction"] == 1.0 for p in out["passes"].values())
    assert {c["dtype"] for c in out["kernel_checks"]} == {"bfloat16"}
    bad = config(tmp_path, "bad", dtype="bfloat16", extra="attention-decode-long: off_by_constant\n")
    rc, out = probe(capsys, "--reference", str(ref), "--config", bad, "--compare-dtype", "float32",
                    "--kernel-checks", "none")
    assert rc == 1 and out["passes"]["long_decode"]["early_divergence_fraction"] >= 6 / 14


def test_a_running_servers_kernels_are_checked_while_it_answers_the_prompts(server, tmp_path):
    """Against --base-url (the live correctness probe on a GPU) the kernel check starts with the completions, not
    after them: it finds the server still answering the probe's prompts, and its result is the probe's."""
    def finished() -> float:
        text = httpx.get(f"{server}/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total"))

    check = tmp_path / "check.py"
    check.write_text(
        "import json, urllib.request\n"
        f"text = urllib.request.urlopen('{server}/metrics').read().decode()\n"
        "done = sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith('vllm:request_success_total'))\n"
        "print(json.dumps({'passed': True, 'checked': [{'passed': True, 'finished': done}]}))\n")
    before = finished()
    lengths = ["1", "7", "16", "17", "33", "64", "150", "200"]
    proc = subprocess.run([PY, "-m", "orchestrator.probes.greedy", "--reference", str(tmp_path / "ref.json"),
                           "--base-url", server, "--lengths", *lengths, "--max-tokens", "24",
                           "--check-command", f"{PY} {check}"],
                          capture_output=True, text=True, timeout=300, env=env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    out = last_json(proc.stdout)
    assert out["recorded"] and out["passed"]
    [checked] = out["kernel_checks"]
    asked = 2 * len(lengths)  # the reference is recorded from two passes
    assert finished() - before == asked
    assert checked["finished"] - before < asked / 2, checked


def test_a_kernel_check_that_cannot_start_fails_the_probe_saying_why(server, tmp_path):
    """Against --base-url the check starts before the completions; one that cannot start is still a failed check
    named in the result, not a crash of the probe."""
    proc = subprocess.run([PY, "-m", "orchestrator.probes.greedy", "--reference", str(tmp_path / "ref.json"),
                           "--base-url", server, "--lengths", "3", "--max-tokens", "4",
                           "--check-command", str(tmp_path / "no-such-check")],
                          capture_output=True, text=True, timeout=300, env=env(), cwd=REPO)
    out = last_json(proc.stdout)
    assert proc.returncode == 1 and not out["passed"], proc.stderr
    [check] = out["kernel_checks"]
    assert not check["passed"] and "cannot run the kernel check" in check["error"] and "no-such-check" in check["error"]


def test_checking_a_live_servers_kernels_imports_no_torch():
    """With --served the probe runs no engine: it asks the server which kernels it runs and starts their checks,
    so its own start pays no torch import (seconds on a GPU host, once per candidate)."""
    code = "import sys, orchestrator.probes.engine_correct; assert 'torch' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
