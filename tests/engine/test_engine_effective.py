"""engine.effective: two serve configs run the same computation exactly when their effective configurations are
equal; keys that change nothing here are listed as ignored, with why."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine.config import load_config
from engine.effective import effective

REPO = Path(__file__).resolve().parents[2]
BASE = {**yaml.safe_load((REPO / "engine" / "configs" / "baseline.yaml").read_text()), "device": "cpu"}


def run(change: dict, base: dict = BASE) -> tuple[dict, dict]:
    return effective(load_config(base))["configuration"], effective(load_config({**base, **change}))


@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch):
    import kernels
    monkeypatch.setattr(kernels, "INTERPRET_REQUESTED", False)


@pytest.mark.parametrize("change, ignored", [
    ({"gpu-memory-utilization": 0.95}, "gpu-memory-utilization"),  # the CPU cache is sized by kv-cache-memory
    ({"attention-decode-long": "v2", "decode-long-threshold": 4096}, "attention-decode-long"),  # none is long
    ({"attention-decode": ["v2_triton", "v1"]}, "attention-decode"),  # Triton does not run on a CPU
    ({"rms-norm": ["triton", "torch"], "qk-norm-rope": ["triton", "torch"]}, "rms-norm"),
    ({"prefill-block-n": 128, "prefill-num-warps": 4}, "prefill-block-n"),  # the loop prefill uses neither
    ({"cuda-graphs": True}, "cuda-graphs"),
])
def test_changes_that_run_nothing_different_here_are_equal(change, ignored):
    base, cand = run(change)
    assert cand["configuration"] == base
    assert ignored in cand["ignored"] and cand["ignored"][ignored]


@pytest.mark.parametrize("change, key, values", [
    ({"max-num-seqs": 256}, "max-num-seqs", (1, 256)),
    ({"attention-prefill": ["triton", "pregather"]}, "attention-prefill", ("loop", "pregather")),
    ({"moe-dispatch": "sorted"}, "moe-dispatch", ("gather", "sorted")),
    ({"kv-cache-memory": 1 << 28}, "kv-cache-memory", (1 << 30, 1 << 28)),
    ({"num-layers": 3}, "model", None),
])
def test_changes_that_run_something_else_differ(change, key, values):
    base, cand = run(change)
    assert cand["configuration"] != base
    if values:
        assert (base[key], cand["configuration"][key]) == values


def test_the_long_decode_kernel_counts_once_a_decode_can_be_long():
    long_ctx = {**BASE, "decode-long-threshold": 1024}  # decodes past 1K of the 4K max-model-len are long
    base, cand = run({"attention-decode-long": "v2"}, long_ctx)
    assert (base["attention-decode-long"], cand["configuration"]["attention-decode-long"]) == ("v1", "v2")
    base, cand = run({"decode-long-threshold": 65536}, long_ctx)  # those decodes leave the long path
    assert "attention-decode-long" not in cand["configuration"] and cand["configuration"] != base


def test_a_hybrid_model_ignores_prefix_caching_and_resolves_its_gated_deltanet_kernels():
    hybrid = {**BASE, "model": "tiny-hybrid"}
    base, cand = run({"enable-prefix-caching": False}, hybrid)
    assert cand["configuration"] == base and base["prefix-caching"] is False
    assert base["gdn-prefill"] == "chunk" and base["gdn-decode"] == "recurrent" and base["gdn-fused"] == "torch"
    dense = effective(load_config(BASE))["configuration"]
    assert "gdn-prefill" not in dense and "gdn-fused" not in dense


def test_the_command_prints_one_result_line_and_names_a_bad_key(tmp_path):
    good = tmp_path / "serve.yaml"
    good.write_text(yaml.safe_dump({**BASE, "gpu-memory-utilization": 0.5}))
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "engine.effective", "--config", str(good)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["configuration"] == effective(load_config(BASE))["configuration"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-num-seqs: lots\n")
    before = bad.read_bytes()
    out = subprocess.run([sys.executable, "-m", "engine.effective", "--config", str(bad)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 2
    error = json.loads(out.stdout.strip().splitlines()[-1])["error"]
    assert str(bad) in error and "max-num-seqs" in error
    assert bad.read_bytes() == before


def on_a_card(monkeypatch, gib: float) -> None:
    """effective() as on a GPU of `gib` GiB without kv-cache-memory (the kernels still chosen on the CPU)."""
    import types

    import torch

    import engine.model_runner
    monkeypatch.setattr(engine.model_runner, "fixed_cache_budget", lambda config, device_type: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=int(gib * 2**30)))


QWEN4 = {**BASE, "model": "qwen3.6-35b-a3b", "num-layers": 4, "dtype": "bfloat16", "max-num-seqs": 256}


def test_a_larger_memory_share_runs_the_same_where_the_cache_already_holds_every_sequence(monkeypatch):
    on_a_card(monkeypatch, 80)
    base = effective(load_config(QWEN4), max_context=1201)
    cand = effective(load_config({**QWEN4, "gpu-memory-utilization": 0.95}), max_context=1201)
    assert cand["configuration"] == base["configuration"]
    assert base["configuration"]["kv-cache"] == "holds every sequence"
    assert "(256) sequences of 1201 tokens" in cand["ignored"]["gpu-memory-utilization"]


def test_a_larger_memory_share_counts_where_the_cache_may_not_hold_every_sequence(monkeypatch):
    # 4 layers of weights are 8.2 GiB: on a 12 GiB card neither share leaves enough by the pessimistic count
    on_a_card(monkeypatch, 12)
    base = effective(load_config(QWEN4), max_context=1201)
    cand = effective(load_config({**QWEN4, "gpu-memory-utilization": 0.95}), max_context=1201)
    assert cand["configuration"] != base["configuration"]
    assert (base["configuration"]["gpu-memory-utilization"], cand["configuration"]["gpu-memory-utilization"]) == (
        0.9, 0.95)
    assert "gpu-memory-utilization" not in cand["ignored"]


def test_the_cache_holds_every_sequence_only_past_a_pessimistic_count_of_the_rest_of_the_card():
    from engine.effective import CACHE_RESERVE, cache_holds_all

    config = load_config(QWEN4)
    hf, gib = config.hf, 2**30
    block = hf.kv_bytes_per_token(2) * config.block_size
    rest = (hf.num_params() * 2 + 257 * hf.state_bytes_per_sequence(2, config.state_dtype().itemsize)
            + 4096 * 4096 * hf.num_heads * 4)
    need = 256 * 76 * block  # 256 sequences of 1,201 tokens in blocks of 16
    card = (rest + need) / (config.gpu_memory_utilization - CACHE_RESERVE)  # exactly enough
    assert cache_holds_all(config, 2, int(card) + gib // 64, 1201)
    assert not cache_holds_all(config, 2, int(card) - gib // 64, 1201)
    assert not cache_holds_all(load_config({**QWEN4, "max-num-seqs": 512}), 2, int(card) + gib // 64, 1201)


# Each serve-config key, changed from the hybrid base below: a key missing here fails the test, so a key the
# engine gains cannot be left out of its effective configuration unnoticed (the configuration probe would then
# roll a real change back unmeasured, as `mamba-ssm-cache-dtype` once was on a GPU).
HYBRID = {**BASE, "model": "tiny-hybrid", "max-model-len": 4096, "decode-long-threshold": 1024}
CHANGES = {
    "model": "tiny", "num_layers": 8, "dtype": "bfloat16", "seed": 1, "max_num_seqs": 8,
    "max_num_batched_tokens": 4096, "gpu_memory_utilization": 0.5, "kv_cache_memory": 1 << 28, "block_size": 32,
    "enable_prefix_caching": False, "max_model_len": 2048, "attention_decode": "v2", "attention_decode_long": "v2",
    "decode_long_threshold": 2048, "attention_prefill": "pregather", "prefill_block_m": 32, "prefill_block_n": 32,
    "prefill_num_warps": 4, "moe_dispatch": "sorted", "gdn_prefill": "recurrent", "gdn_decode": "chunk",
    "gdn_fused": ["triton", "torch"], "mamba_ssm_cache_dtype": "bfloat16", "rms_norm": ["triton", "torch"], "qk_norm_rope": ["triton", "torch"],
    "cuda_graphs": True, "async_scheduling": True, "stream_interval": 4,
}
NOT_ON_A_CPU = {"device": "the device itself: effective() describes the one it runs on"}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_every_serve_config_key_changes_the_configuration_or_is_ignored_with_a_reason(field):
    from dataclasses import fields

    from engine.config import EngineConfig

    assert {f.name for f in fields(EngineConfig)} == set(CHANGES) | set(NOT_ON_A_CPU)
    key = field.replace("_", "-")
    base = effective(load_config(HYBRID))
    cand = effective(load_config({**HYBRID, key: CHANGES[field]}))
    why = cand["ignored"].get(key) or base["ignored"].get(key)  # either side may be the one that runs nothing
    assert cand["configuration"] != base["configuration"] or why, f"{key}: changed, but neither differs nor ignored"


def test_the_recurrent_state_dtype_is_part_of_a_hybrid_models_configuration_and_ignored_elsewhere():
    base, cand = run({"mamba-ssm-cache-dtype": "bfloat16"}, HYBRID)
    assert (base["mamba-ssm-cache-dtype"], cand["configuration"]["mamba-ssm-cache-dtype"]) == ("float32", "bfloat16")
    base, cand = run({"mamba-ssm-cache-dtype": "float32"}, HYBRID)  # what the model declares: the same state
    assert cand["configuration"] == base
    base, cand = run({"mamba-ssm-cache-dtype": "bfloat16"})  # a dense model holds no such state
    assert cand["configuration"] == base and "no Gated DeltaNet layer" in cand["ignored"]["mamba-ssm-cache-dtype"]
