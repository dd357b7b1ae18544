"""max-num-seqs-256's verify: the seed's KV-cache arithmetic from the model config, on both targets,
run the way the orchestrator runs it (hook_runner in a child process, cwd = the serve root)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "optimizations" / "max-num-seqs-256"
HOOK_RUNNER = REPO / "orchestrator" / "hook_runner.py"
ARGS = {"serve_config": "serve.yaml", "seqs": 256, "tokens": 2048}

# Qwen3.6-35B-A3B as the seed counts it: 40 layers x 2 KV heads x 256 x 2 (K, V) x 2 bytes = 80 KiB per token
QWEN36 = {"hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
          "head_dim": 256, "torch_dtype": "bfloat16"}
SEED_NEED = 256 * 2048 * 80 * 1024  # 40 GiB (42.9e9 bytes; the seed rounds it to "41.9 GB")


def hook(root: Path, function: str, env: dict | None = None, **args) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    full_env.pop("ORCHESTRATOR_VLLM_MODEL", None)
    return subprocess.run([sys.executable, str(HOOK_RUNNER), str(PLUGIN), function, json.dumps({**ARGS, **args}),
                           "check"], cwd=root, env=full_env, capture_output=True, text=True, timeout=120)


def vllm_deployment(tmp_path: Path, serve: str, config: dict = QWEN36) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    (tmp_path / "serve.yaml").write_text(serve)
    return tmp_path


def test_vllm_seed_arithmetic_fits_in_45_gb(tmp_path):
    root = vllm_deployment(tmp_path, "model: model\nkv-cache-memory-bytes: 45000000000\n")
    result = hook(root, "kv_cache_fits_vllm")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "80.0 KiB/token" in result.stdout and "40.00 GiB fits" in result.stdout


def test_vllm_too_little_cache_fails_with_the_numbers(tmp_path):
    root = vllm_deployment(tmp_path, f"model: model\nkv-cache-memory-bytes: {SEED_NEED - 1}\n")
    result = hook(root, "kv_cache_fits_vllm")
    assert result.returncode == 1
    assert "does NOT fit" in result.stdout


def test_vllm_fp8_cache_and_hybrid_layers_count(tmp_path):
    """Only full-attention layers hold KV (Qwen3.6 interleaves 3 linear-attention layers per full one)."""
    hybrid = {**QWEN36, "layer_types": ["linear_attention"] * 3 * 10 + ["full_attention"] * 10}
    root = vllm_deployment(tmp_path, "model: model\nkv-cache-dtype: fp8\nkv-cache-memory-bytes: 6000000000\n",
                           hybrid)
    result = hook(root, "kv_cache_fits_vllm")
    assert result.returncode == 0, result.stdout
    assert "10.0 KiB/token" in result.stdout  # 10 layers x 2 x 256 x 2 x 1 byte


def test_vllm_model_from_the_hugging_face_cache(tmp_path):
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3.6-35B-A3B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(QWEN36))
    (tmp_path / "serve.yaml").write_text("model: Qwen/Qwen3.6-35B-A3B\nkv-cache-memory-bytes: 45000000000\n")
    result = hook(tmp_path, "kv_cache_fits_vllm", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("serve, why", [
    ("max-num-seqs: 256\n", "names no model"),
    ("model: nowhere/to-be-found\n", "neither a local folder nor in the Hugging Face cache"),
    ("model: model\n", "no GPU is visible and the serve config sets no kv-cache-memory-bytes"),
])
def test_vllm_not_verifiable_says_why(tmp_path, serve, why):
    root = vllm_deployment(tmp_path, serve)
    result = hook(root, "kv_cache_fits_vllm", env={"HF_HUB_CACHE": str(tmp_path / "empty-hub"),
                                                    "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1
    assert result.stdout.startswith("not verifiable: ") and why in result.stdout


def test_engine_check_reads_the_workspace_serve_config(tmp_path):
    baseline = (REPO / "engine" / "configs" / "baseline.yaml").read_text()
    # tiny preset on the CPU: 2 x 2 layers x 2 kv heads x 32 x 4 bytes = 1 KiB per token -> 512 MiB needed
    (tmp_path / "serve.yaml").write_text(baseline + "device: cpu\nkv-cache-memory: 600000000\n")
    fits = hook(tmp_path, "kv_cache_fits_engine")
    assert fits.returncode == 0, fits.stdout + fits.stderr
    (tmp_path / "serve.yaml").write_text(baseline + "device: cpu\nkv-cache-memory: 500000000\n")
    too_small = hook(tmp_path, "kv_cache_fits_engine")
    assert too_small.returncode == 1 and "does NOT fit" in too_small.stdout


def test_weights_of_a_dummy_loaded_model_are_counted_from_its_config(tmp_path):
    """vllm serve --load-format dummy needs no weight files: the check counts the parameters instead."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kv_hooks", PLUGIN / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    config = {**QWEN36, "vocab_size": 248320, "num_experts": 256, "num_experts_per_tok": 8,
              "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "attn_output_gate": True,
              "dtype": "bfloat16"}
    root = vllm_deployment(tmp_path, "model: model\n", config)
    weights, what = hooks.weight_bytes(root / "model", config)
    assert 64e9 < weights < 72e9 and "parameters of config.json" in what  # 64.6 GiB measured by vLLM on an H200
    (root / "model" / "model.safetensors").write_bytes(b"x" * 1000)
    assert hooks.weight_bytes(root / "model", config) == (1000, "weights")
    assert hooks.weight_bytes(root, {})[0] == 0  # no config.json there: nothing to count


def test_vllm_hybrid_model_counts_each_sequences_linear_attention_state(tmp_path):
    """Qwen3.6's real config: 10 attention layers (20 KiB/token in bf16) and 30 Gated DeltaNet layers,
    each sequence holding 30 x (32 x 128 x 128 float32 + 8,192 x 3 bf16) = 61.4 MiB of state."""
    real = {**QWEN36, "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(40)],
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32"}
    need = 256 * (2048 * 20 * 1024 + 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2))  # 25.35 GiB
    root = vllm_deployment(tmp_path, f"model: model\nkv-cache-memory-bytes: {need + 1}\n", real)
    result = hook(root, "kv_cache_fits_vllm")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "20.0 KiB/token + 61.4 MiB/sequence" in result.stdout
    (root / "serve.yaml").write_text(f"model: model\nkv-cache-memory-bytes: {need - 1}\n")
    assert hook(root, "kv_cache_fits_vllm").returncode == 1  # the KV alone (10 GiB) would fit
    # with the recurrent state in bf16 (mamba-ssm-cache-dtype), each sequence holds 31.4 MiB, and the same
    # memory now fits
    (root / "serve.yaml").write_text(f"model: model\nkv-cache-memory-bytes: {need - 1}\n"
                                     "mamba-ssm-cache-dtype: bfloat16\n")
    result = hook(root, "kv_cache_fits_vllm")
    assert result.returncode == 0 and "20.0 KiB/token + 31.4 MiB/sequence" in result.stdout, result.stdout
