"""The real CLI stages every shipped plugin on real vLLM source, with quick local probes.

The throughput probe reports a constant, so every plugin that applies and verifies ends
`rolled_back: no_gain`; the vLLM tree and the serve config must then be byte-identical to before.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from vllm_source import ENGINE_ONLY, FORK_ONLY, NEWER_ONLY, ON_PINNED, OPTIMIZATIONS, REPO


# Qwen3-30B-A3B's attention shapes: 48 layers x 4 KV heads x 128 x 2 (K, V) x 2 bytes = 96 KiB per token
HF_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
             "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "torch_dtype": "bfloat16",
             "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}
SERVE = """# vllm serve --config
model: {model}
max-num-seqs: 1
max-num-batched-tokens: 8192
gpu-memory-utilization: 0.9
kv-cache-memory-bytes: 60000000000
"""
CONFIG = """target: {{kind: vllm, package: vllm, serve_config: serve/serve.yaml, env: {{VLLM_USE_V1: "0"}}}}
plugins: {plugins}
state: state
probes:
  - {{name: correct, role: correctness, command: [python, -c, "print('{{\\"passed\\": true}}')"], timeout: 60}}
  - {{name: speed, role: throughput, command: [python, -c, {speed}], timeout: 60, objective: score}}
policy: {{repeats: 1}}
"""


CONSTANT = """print('{"score": 1.0}')"""


def deployment(tmp: Path, vllm_tree: Path, speed: str = CONSTANT) -> Path:
    """A folder with orchestrator.yaml, a copy of the vllm package, a serve config and a model config."""
    shutil.copytree(vllm_tree, tmp / "vllm")
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(json.dumps(HF_CONFIG))
    (tmp / "serve").mkdir()
    (tmp / "serve" / "serve.yaml").write_text(SERVE.format(model=tmp / "model"))
    (tmp / "orchestrator.yaml").write_text(CONFIG.format(plugins=OPTIMIZATIONS, speed=json.dumps(speed)))
    return tmp


def cli(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "--config", "orchestrator.yaml"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def staged(folder: Path) -> dict[str, list[tuple[str, str]]]:
    """Run, then the (outcome, reason) of every staged variant per plugin; the tree must be unchanged."""
    before = {"vllm": digest(folder / "vllm"), "serve": digest(folder / "serve")}
    result = cli(folder, "run")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {"vllm": digest(folder / "vllm"), "serve": digest(folder / "serve")} == before
    status = cli(folder, "status", "--json")
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert data["run"]["status"] == "finished"
    outcomes: dict[str, list[tuple[str, str]]] = {}
    for step in data["steps"]:
        outcomes.setdefault(step["plugin"], []).append((step["outcome"], step["reason"]))
    return outcomes


def test_pinned_vllm_every_applicable_plugin_applies_verifies_and_rolls_back(vllm_pinned, tmp_path):
    outcomes = staged(deployment(tmp_path, vllm_pinned))
    for pid in ON_PINNED:
        assert set(outcomes[pid]) == {("rolled_back", "no_gain")}, (pid, outcomes[pid])
    for pid in FORK_ONLY | ENGINE_ONLY | NEWER_ONLY:
        assert outcomes[pid] == [("skipped", "not_applicable")], (pid, outcomes[pid])
    assert len(outcomes["prefill-triton-tuning"]) == 8
    assert len(outcomes["max-num-seqs-search"]) == 2


def test_newest_vllm_no_plugin_fails(vllm_newest, tmp_path):
    outcomes = staged(deployment(tmp_path, vllm_newest))
    assert set(outcomes) == ON_PINNED | FORK_ONLY | ENGINE_ONLY | NEWER_ONLY
    for pid, results in outcomes.items():
        for outcome, reason in results:
            assert reason not in ("apply_failed", "verify_failed"), (pid, outcome, reason)
            assert (outcome, reason) in {("rolled_back", "no_gain"), ("skipped", "not_applicable")}, (pid, reason)
    assert set(outcomes["max-num-seqs-256"]) == {("rolled_back", "no_gain")}


def fork(vllm_tree: Path, dest: Path) -> Path:
    """vLLM 0.10.2 edited to carry the code the seed's fork describes (the fork's own source is not public)."""
    shutil.copytree(vllm_tree, dest)
    edit(dest / "attention/ops/paged_attn.py", [
        ("from vllm.triton_utils import HAS_TRITON\n", "HAS_TRITON = False\n_PYTORCH_DECODE_THRESHOLD = 32768\n"),
        ("use_v1 = (max_seq_len <= 8192\n                  and (max_num_partitions == 1 or num_seqs * num_heads > 512))",
         "use_v1 = True"),
    ])
    edit(dest / "_custom_ops.py", [("    torch.ops._C.paged_attention_v1(", "    ixf_F.paged_attention_v1(")])
    edit(dest / "attention/backends/xformers.py", [
        ("    def _run_memory_efficient_xformers_forward(",
         "    def _run_sdpa_fallback(self, query, key, value):\n"
         "        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)\n\n"
         "    def _run_memory_efficient_xformers_forward("),
    ])
    return dest


def edit(path: Path, pairs: list[tuple[str, str]]) -> None:
    text = path.read_text()
    for old, new in pairs:
        assert text.count(old) == 1, (path, old)
        text = text.replace(old, new)
    path.write_text(text)


def test_fork_only_plugins_apply_where_the_fork_code_is(vllm_pinned, tmp_path):
    outcomes = staged(deployment(tmp_path, fork(vllm_pinned, tmp_path / "fork")))
    for pid in FORK_ONLY | ON_PINNED:
        assert set(outcomes[pid]) == {("rolled_back", "no_gain")}, (pid, outcomes[pid])


def test_a_changed_signature_fails_verify(vllm_pinned, tmp_path):
    """The anchor still matches, but vLLM's paged_attention_v2 has a new parameter: the shim would be wrong."""
    folder = deployment(tmp_path, vllm_pinned)
    edit(folder / "vllm/_custom_ops.py", [("    blocksparse_head_sliding_step: int = 0,\n) -> None:\n"
                                           "    torch.ops._C.paged_attention_v2(",
                                           "    blocksparse_head_sliding_step: int = 0,\n    sinks=None,\n) -> None:\n"
                                           "    torch.ops._C.paged_attention_v2(")])
    outcomes = staged(folder)
    assert outcomes["decode-v2-triton"] == [("rolled_back", "verify_failed")]
    assert outcomes["decode-v2-layout"] == [("rolled_back", "verify_failed")]


KEEPING_PROBE = """
import json, os, pathlib, yaml
package = pathlib.Path(os.environ["ORCHESTRATOR_ROOT_VLLM"])
serve = yaml.safe_load((pathlib.Path(os.environ["ORCHESTRATOR_ROOT_SERVE"]) / "serve.yaml").read_text())
shim = (package / "attention/ops/_orchestrator_prefill_triton.py").is_file()
print(json.dumps({"score": 10 + (serve["max-num-seqs"] == 256) + shim}))
"""


def test_a_new_container_on_an_old_volume_restages_the_source_patches(vllm_pinned, tmp_path):
    """The package is back to the image's files, the state and serve config are the volume's."""
    folder = deployment(tmp_path, vllm_pinned, speed=KEEPING_PROBE)
    pristine = digest(folder / "vllm")
    first = cli(folder, "run")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    shim = folder / "vllm/attention/ops/_orchestrator_prefill_triton.py"
    assert shim.is_file()
    shutil.rmtree(folder / "vllm")
    shutil.copytree(vllm_pinned, folder / "vllm")
    assert digest(folder / "vllm") == pristine
    second = cli(folder, "run")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    steps = json.loads(cli(folder, "status", "--json").stdout)["steps"]
    outcome = {s["plugin"]: (s["outcome"], s["reason"]) for s in steps if s["outcome"] == "kept"}
    assert outcome == {"max-num-seqs-256": ("kept", "already_applied"), "prefill-triton": ("kept", None)}
    assert shim.is_file()
