"""Every shipped plugin's anchors against real vLLM source, applied in memory (fast, no CLI)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from orchestrator import patchcheck
from orchestrator.plugin import load_all
from orchestrator.steps import StepContext, check, compute
from vllm_source import ENGINE_ONLY, FORK_ONLY, NEWER_ONLY, ON_PINNED, OPTIMIZATIONS, SERVE_OPTIONS, probe_env



def stage_in_memory(package: Path, serve_dir: Path):
    """(plugin id -> 'not_applicable' | {path: patched text}) for each plugin's every variant."""
    roots = {"vllm": package, "serve": serve_dir}
    outcome = {}
    for plugin in load_all(OPTIMIZATIONS, roots, {"serve_config": "serve.yaml"}):
        if "vllm" not in plugin.manifest.targets:
            outcome[plugin.id] = "not_vllm"
            continue
        ctx = StepContext(roots=roots, kind="vllm", plugin_dir=plugin.folder, env=probe_env(package))
        for variant in plugin.variants:
            if not all(check(c, ctx)[0] for c in variant.applies_if if c.runs_on("vllm")):
                outcome[plugin.id] = "not_applicable"
                break
            files: dict[Path, bytes] = {}
            for step in variant.apply:
                if step.runs_on("vllm"):
                    _, _, full, data = compute(step, ctx, lambda p: files.get(p, p.read_bytes() if p.is_file() else None))
                    files[full] = data
            outcome.setdefault(plugin.id, []).append(files)
    return outcome


@pytest.fixture
def serve_dir(tmp_path):
    (tmp_path / "serve.yaml").write_text("model: Qwen/Qwen3-30B-A3B\nmax-num-seqs: 1\n")
    return tmp_path


def test_pinned_vllm_anchor_sets(vllm_pinned, serve_dir):
    outcome = stage_in_memory(vllm_pinned, serve_dir)
    assert {k for k, v in outcome.items() if isinstance(v, list)} == ON_PINNED
    assert {k for k, v in outcome.items() if v == "not_applicable"} == FORK_ONLY | NEWER_ONLY
    assert {k for k, v in outcome.items() if v == "not_vllm"} == ENGINE_ONLY


def test_pinned_patches_compile_and_keep_signatures(vllm_pinned, serve_dir):
    outcome = stage_in_memory(vllm_pinned, serve_dir)
    assert len(outcome["prefill-triton-tuning"]) == 8  # 2 x 2 x 2 parameter combinations
    for pid in ON_PINNED:
        for files in outcome[pid]:
            for path, data in files.items():
                if path.suffix == ".py":
                    compile(data, str(path), "exec")
                    if path.exists():  # a patched vLLM file: every function keeps its parameters
                        before = defs(path.read_bytes())
                        after = defs(data)
                        assert after == before, f"{pid} changed a signature in {path}"


def test_tuning_variants_edit_the_non_alibi_launch(vllm_pinned, serve_dir):
    variants = stage_in_memory(vllm_pinned, serve_dir)["prefill-triton-tuning"]
    texts = {next(iter(f.values())).decode() for f in variants}
    assert len(texts) == 8
    assert any("BLOCK_M=64,\n        BLOCK_N=128,\n        num_unroll_cache=4,\n        num_unroll_request=1,\n"
               "        num_warps=8," in t for t in texts)


def test_newest_vllm_no_anchor_fails(vllm_newest, serve_dir):
    """On the newest vLLM a plugin is either not applicable or its patches apply and compile."""
    outcome = stage_in_memory(vllm_newest, serve_dir)
    for pid, result in outcome.items():
        if isinstance(result, list):
            for files in result:
                for path, data in files.items():
                    if path.suffix == ".py":
                        compile(data, str(path), "exec")
    assert outcome["max-num-seqs-256"] != "not_applicable"
    for pid in SERVE_OPTIONS | NEWER_ONLY:  # every serve option these plugins set exists in the newest vLLM
        assert isinstance(outcome[pid], list), (pid, outcome[pid])


def defs(source: bytes) -> dict[str, list[str]]:
    tree = ast.parse(source)
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{item.name}"] = patchcheck.signature(item)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.col_offset == 0:
            out[node.name] = patchcheck.signature(node)
    return out


def test_torch_compile_does_not_apply_where_the_newest_vllm_compiles_nothing_of_the_served_model(vllm_newest, tmp_path):
    """Served a Qwen3.6-shaped model folder (its config.json names Qwen3_5MoeForCausalLM, as mkmodel.py writes it),
    the newest vLLM's source shows an eager NVIDIA implementation: torch-compile is not applicable, and every other
    plugin that needs a newer vLLM still applies."""
    (tmp_path / "qwen36").mkdir()
    (tmp_path / "qwen36" / "config.json").write_text('{"architectures": ["Qwen3_5MoeForCausalLM"]}')
    (tmp_path / "serve.yaml").write_text(f"model: {tmp_path / 'qwen36'}\nmax-num-seqs: 1\n")
    outcome = stage_in_memory(vllm_newest, tmp_path)
    assert outcome["torch-compile"] == "not_applicable"
    assert all(isinstance(outcome[pid], list) for pid in NEWER_ONLY - {"torch-compile"}), outcome
