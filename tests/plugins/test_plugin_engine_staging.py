"""The shipped plugins staged by the real CLI on the engine target, with a quick throughput probe.

The probe scores how many kernel and scheduling keys of the workspace serve config match the
engine's fully optimized config, so the orchestrator's own decisions must keep exactly the plugins
that move toward it (and the best tuning candidate), end with that config, and `rollback` must then
restore the baseline byte for byte. Verification runs for real: the engine loads every candidate
config and the KV-cache check runs on the workspace.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from engine.config import load_config

REPO = Path(__file__).resolve().parents[2]
OPTIMIZATIONS = REPO / "optimizations"
CONFIGS = REPO / "engine" / "configs"

PROBE = """
import json, os, pathlib, yaml
workspace = pathlib.Path(os.environ["ORCHESTRATOR_ROOT_WORKSPACE"])
current = yaml.safe_load((workspace / "serve.yaml").read_text())
target = yaml.safe_load(pathlib.Path({optimized!r}).read_text())
# the Triton prefill's launch parameters are timed on the machine by prefill-triton-autotune: not scored
launch = {{"prefill-block-m", "prefill-block-n", "prefill-num-warps"}}
print(json.dumps({{"score": 10 + sum(current.get(k) == v for k, v in target.items() if k not in launch)}}))
"""
LAUNCH = ("prefill_block_m", "prefill_block_n", "prefill_num_warps")
CONFIG = """target: {{kind: engine, workspace: ws}}
plugins: {plugins}
state: state
probes:
  - {{name: correct, role: correctness, command: [python, -c, "print('{{\\"passed\\": true}}')"], timeout: 60}}
  - name: closeness
    role: throughput
    objective: score
    timeout: 60
    command: [python, -c, {probe}]
policy: {{rule: first, repeats: 1, min_gain: 0.02}}
"""


def cli(folder: Path, *args: str) -> subprocess.CompletedProcess:
    # the tuning plugin applies only where the engine would run the Triton prefill: a GPU or, as here,
    # Triton's interpreter asked for
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "--config", "orchestrator.yaml"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=900)


def test_engine_keeps_what_moves_toward_the_optimized_config_and_rolls_back(tmp_path):
    probe = PROBE.format(optimized=str(CONFIGS / "optimized.yaml"))
    (tmp_path / "orchestrator.yaml").write_text(CONFIG.format(plugins=OPTIMIZATIONS, probe=json.dumps(probe)))
    serve = tmp_path / "ws" / "serve.yaml"
    serve.parent.mkdir()
    # the hybrid model, so that the Gated DeltaNet plugins apply too
    baseline = (CONFIGS / "baseline.yaml").read_text().replace("model: tiny ", "model: tiny-hybrid ", 1).encode()
    serve.write_bytes(baseline)
    run = cli(tmp_path, "run")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    status = json.loads(cli(tmp_path, "status", "--json").stdout)
    outcomes: dict[str, list] = {}
    for step in status["steps"]:
        outcomes.setdefault(step["plugin"], []).append((step["outcome"], step["reason"], step.get("params")))

    # cuda-graphs and async-scheduling apply only where the engine runs on a GPU
    for pid in ("fork-head-mapping-tensor", "fork-xformers-flash-prefill", "fork-enable-triton", "cuda-graphs",
                "async-scheduling"):
        assert outcomes[pid] == [("skipped", "not_applicable", None)]
    for pid in ("max-num-seqs-256", "max-batched-tokens-32k", "gpu-memory-095", "decode-v2-triton",
                "prefill-triton", "moe-triton", "fused-norm-rope", "gdn-prefill-triton", "gdn-decode-triton",
                "gdn-fused-triton", "ssm-state-bf16"):
        assert [o[:2] for o in outcomes[pid]] == [("kept", None)], (pid, outcomes[pid])
    assert outcomes["decode-threshold-64k"][0][:2] == ("rolled_back", "regressed")
    assert outcomes["prefill-triton-tuning"] == [("skipped", "not_applicable", None)]  # vLLM's copy
    # the autotuner ran and wrote a launch of the grid; the probe does not score launches, so no gain
    assert [o[:2] for o in outcomes["prefill-triton-autotune"]] == [("rolled_back", "no_gain")]
    for result in outcomes.values():  # nothing failed to apply or verify
        assert not {o[1] for o in result} & {"apply_failed", "verify_failed"}, outcomes

    kept = load_config(serve).as_dict()
    optimized = load_config(CONFIGS / "optimized.yaml", {"model": "tiny-hybrid"}).as_dict()
    assert (kept.pop("cuda_graphs"), optimized.pop("cuda_graphs")) == (False, True)
    assert (kept.pop("async_scheduling"), optimized.pop("async_scheduling")) == (False, True)
    assert {k: kept.pop(k) for k in LAUNCH} == {"prefill_block_m": 64, "prefill_block_n": 64,
                                                "prefill_num_warps": 8}  # the baseline's, put back
    assert kept == {k: v for k, v in optimized.items() if k not in LAUNCH}
    assert yaml.safe_load(serve.read_text())["max-num-seqs"] == 256

    back = cli(tmp_path, "rollback", "--all")
    assert back.returncode == 0, back.stdout[-3000:] + back.stderr[-3000:]
    assert serve.read_bytes() == baseline


def test_tuning_is_not_applicable_where_the_engine_would_not_run_triton(tmp_path):
    """On the CPU without TRITON_INTERPRET the engine falls back from Triton, so searching its launch
    parameters would measure nothing: the precondition says so."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    serve = tmp_path / "serve.yaml"
    base = (CONFIGS / "baseline.yaml").read_text()
    script = ("import sys; sys.path.insert(0, %r); import hooks; "
              "sys.exit(0 if hooks.triton_prefill_in_use(%r, 'serve.yaml') else 3)")
    hooks = OPTIMIZATIONS / "prefill-triton-autotune"
    outcomes = []
    for prefill, extra_env in (("[triton, pregather]", {}), ("[triton, pregather]", {"TRITON_INTERPRET": "1"}),
                               ("loop", {"TRITON_INTERPRET": "1"})):
        serve.write_text(base.replace("attention-prefill: loop", f"attention-prefill: {prefill}")
                         .replace("device: auto", "device: cpu"))
        proc = subprocess.run([sys.executable, "-c", script % (str(hooks), str(tmp_path))],
                              env={**env, **extra_env}, capture_output=True, text=True, timeout=120)
        outcomes.append(proc.returncode)
    assert outcomes == [3, 0, 3]


def test_gdn_plugins_apply_to_hybrid_models_where_triton_runs(tmp_path):
    """A dense model has no Gated DeltaNet layer to run the kernels on; without a GPU or the
    interpreter the engine would fall back from Triton: in both cases nothing would change."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    base = (CONFIGS / "baseline.yaml").read_text().replace("device: auto", "device: cpu")
    script = ("import sys; sys.path.insert(0, %r); import hooks; "
              "sys.exit(0 if hooks.triton_gdn_in_use(%r, 'serve.yaml') else 3)")
    for plugin in ("gdn-prefill-triton", "gdn-decode-triton", "gdn-fused-triton"):
        outcomes = []
        for model, extra_env in (("tiny-hybrid", {"TRITON_INTERPRET": "1"}), ("tiny-hybrid", {}),
                                 ("tiny", {"TRITON_INTERPRET": "1"})):
            (tmp_path / "serve.yaml").write_text(base.replace("model: tiny ", f"model: {model} ", 1))
            proc = subprocess.run([sys.executable, "-c", script % (str(OPTIMIZATIONS / plugin), str(tmp_path))],
                                  env={**env, **extra_env}, capture_output=True, text=True, timeout=120)
            outcomes.append(proc.returncode)
        assert outcomes == [0, 3, 3], plugin
