import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import ConfigError, load_config
from engine.model_config import PRESETS

CONFIGS = Path(__file__).resolve().parents[2] / "engine" / "configs"


def write(tmp_path, text, name="serve.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_file_and_a_dict_give_the_same_config(tmp_path):
    path = write(tmp_path, "model: tiny\nmax-num-seqs: 4\nattention-decode: [v2, v1]\n")
    from_file, from_dict = load_config(path), load_config({"model": "tiny", "max-num-seqs": 4,
                                                            "attention-decode": ["v2", "v1"]})
    assert from_file.as_dict() == from_dict.as_dict()
    assert from_file.chain("attention-decode") == ["v2", "v1"]
    assert from_file.chain("attention-prefill") == ["pregather"]
    assert from_file.max_model_len == PRESETS["tiny"].max_position_embeddings
    assert from_file.source == str(path)


@pytest.mark.parametrize("text, key, words", [
    ("max-num-seqs: 4\nmax_num_seqs: 4\n", "max_num_seqs", "unknown key"),
    ("speculative: true\n", "speculative", "unknown key"),
    ("max-num-seqs: many\n", "max-num-seqs", "valid integer"),
    ("max-num-seqs: 0\n", "max-num-seqs", "greater than or equal to 1"),
    ("gpu-memory-utilization: 1.5\n", "gpu-memory-utilization", "less than or equal to 1"),
    ("block-size: 12\n", "block-size", "power of two"),
    ("enable-prefix-caching: maybe\n", "enable-prefix-caching", "valid boolean"),
    ("device: tpu\n", "device", "cuda:N"),
    ("dtype: float8\n", "dtype", "float32"),
    ("attention-prefill: flash\n", "attention-prefill", "unknown prefix_prefill variant 'flash'"),
    ("moe-dispatch: [sorted, fused]\n", "moe-dispatch", "unknown moe variant 'fused'"),
    ("attention-decode: []\n", "attention-decode", "names no variant"),
    ("gdn-decode: [triton_recurrent, fused]\n", "gdn-decode", "unknown gated_delta_rule variant 'fused'"),
    ("gdn-fused: [triton, recurrent]\n", "gdn-fused",  # every op of the key needs the variant
     "unknown causal_conv1d/gdn_gating/rms_norm_gated variant 'recurrent'; known: reference, torch, triton"),
    ("gdn-fused: 3\n", "gdn-fused", "a variant name or a list of them"),
    ("model: tiny-hybrid\nnum-layers: 3\n", "num-layers", "no full-attention layer"),
    ("model: gpt-9\n", "model", "neither a preset"),
    ("num-layers: 0\n", "num-layers", "greater than or equal to 1"),
    ("max-model-len: 100000\n", "max-model-len", "max_position_embeddings"),
    ("stream-interval: 0\n", "stream-interval", "greater than or equal to 1"),
    ("stream-interval: 2.5\n", "stream-interval", "valid integer"),
    ("mamba-ssm-cache-dtype: fp8\n", "mamba-ssm-cache-dtype", "float32"),
])
def test_bad_values_name_the_file_and_the_key(tmp_path, text, key, words):
    path = write(tmp_path, "model: tiny\n" + text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert str(exc.value).startswith(f"{path}: {key}: ")
    assert words in str(exc.value)
    assert exc.value.key == key


@pytest.mark.parametrize("text, words", [("[1, 2]\n", "expected a mapping"), ("a: [\n", "not valid YAML")])
def test_a_file_that_is_not_a_mapping_is_refused(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=words) as exc:
        load_config(path)
    assert str(path) in str(exc.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml: -: cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_overrides_apply_on_top_of_the_file_and_errors_still_name_it(tmp_path):
    path = write(tmp_path, "model: tiny\nmax-num-seqs: 4\n")
    assert load_config(path, {"max-num-seqs": 8}).max_num_seqs == 8
    with pytest.raises(ConfigError, match=f"{path}: max-num-seqs: "):
        load_config(path, {"max-num-seqs": -1})


def test_the_qwen_preset_is_described_without_allocating_weights():
    cfg = load_config({"model": "qwen3.6-35b-a3b", "num-layers": 40}).hf
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size) == (2048, 16, 2, 256)
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == \
        (256, 8, 512, 512)
    assert cfg.vocab_size == 248_320 and cfg.rotary_dim == 64
    assert 34e9 < cfg.num_params() < 36e9  # a 35B model
    assert cfg.layer_kinds == ("linear_attention",) * 3 + ("full_attention",) + cfg.layer_kinds[4:]
    assert (cfg.num_attention_layers, cfg.num_linear_layers) == (10, 30)
    assert cfg.kv_bytes_per_token(2) == 20 * 1024  # 10 attention layers x K and V x 2 kv heads x 256 x 2 bytes
    assert cfg.state_bytes_per_sequence(2, 4) == 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)  # about 61 MiB
    assert cfg.state_bytes_per_sequence(2, 2) == 30 * (32 * 128 * 128 * 2 + 8192 * 3 * 2)  # bf16 states
    dense = load_config({"model": "qwen3.6-35b-a3b-dense"}).hf
    assert dense.kv_bytes_per_token(2) == 80 * 1024 and not dense.is_hybrid  # the seed's 80 KB per token
    eight = load_config({"model": "qwen3.6-35b-a3b", "num-layers": 8}).hf
    assert eight.num_layers == 8 and eight.layer_kinds == cfg.layer_kinds[:8]


# The text model of Qwen3.6-35B-A3B's config.json, as vLLM was served with it (rotary settings
# under rope_parameters, both layer_types and full_attention_interval present)
QWEN36_TEXT = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6, "attn_output_gate": True, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
    "num_experts_per_tok": 8, "full_attention_interval": 4,
    "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(40)],
    "mamba_ssm_dtype": "float32",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
}


@pytest.mark.parametrize("model, key, want", [
    ("qwen3.6-35b-a3b", "auto", torch.float32),  # what Qwen3.6's config.json declares, as vLLM reads it
    ("qwen3.6-35b-a3b", "bfloat16", torch.bfloat16),
    ("tiny-hybrid", "float16", torch.float16),
    ("qwen3.6-35b-a3b-dense", "auto", torch.float16),  # declares none: the model's dtype
])
def test_the_recurrent_state_dtype_is_the_models_declared_one_unless_the_config_says(model, key, want):
    cfg = load_config({"model": model, "dtype": "float16", "mamba-ssm-cache-dtype": key})
    assert cfg.state_dtype() == want


def test_the_real_config_json_gives_the_preset(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                                           "text_config": QWEN36_TEXT}))
    assert load_config(write(tmp_path, "model: m\n")).hf == PRESETS["qwen3.6-35b-a3b"]
    interval_only = {k: v for k, v in QWEN36_TEXT.items() if k != "layer_types"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(interval_only))
    assert load_config(write(tmp_path, "model: m\n")).hf.layer_kinds == PRESETS["qwen3.6-35b-a3b"].layer_kinds


@pytest.mark.parametrize("change, words", [
    ({"layer_types": ["linear_attention"] * 39 + ["mamba"]}, "unknown layer type 'mamba'"),
    ({"layer_types": ["full_attention"] * 3}, "must list 40 layer types"),
    ({"full_attention_interval": 0, "layer_types": None}, "full_attention_interval must be a positive integer"),
    ({"linear_num_value_heads": 24}, "linear_num_value_heads 24 is not a multiple"),
    ({"linear_key_head_dim": None, "linear_num_key_heads": 0}, "linear_num_key_heads is 0"),
    ({"mamba_ssm_dtype": "fp8"}, "mamba_ssm_dtype must be one of float32, float16, bfloat16"),
])
def test_bad_hybrid_model_configs_are_named(tmp_path, change, words):
    text = {**QWEN36_TEXT, **change}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in text.items() if v is not None}))
    before = path.read_bytes()
    with pytest.raises(ConfigError, match=f"model: {path}: .*{words}") as exc:
        load_config({"model": str(path)})
    assert exc.value.key == "model" and path.read_bytes() == before


def test_a_hugging_face_config_json_relative_to_the_serve_config(tmp_path):
    (tmp_path / "m").mkdir()
    hf = {"text_config": {"vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                          "partial_rotary_factor": 0.25, "rope_theta": 1e6, "max_position_embeddings": 2048,
                          "attn_output_gate": True}}
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf))
    cfg = load_config(write(tmp_path, "model: m\nnum-layers: 1\n"))
    assert (cfg.hf.vocab_size, cfg.hf.head_size, cfg.hf.num_layers, cfg.hf.rotary_dim) == (1000, 64, 1, 16)
    assert cfg.max_model_len == 2048

    del hf["text_config"]["num_experts"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match="model: .*config.json: missing key 'num_experts'"):
        load_config(write(tmp_path, "model: m\n"))


@pytest.mark.parametrize("name", ["baseline.yaml", "optimized.yaml", "optimized-cpu.yaml"])
def test_the_shipped_configs_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.model == "tiny"
    assert load_config(CONFIGS / name, {"model": "tiny-hybrid"}).hf.is_hybrid


def test_the_baseline_is_the_seed_starting_point():
    cfg = load_config(CONFIGS / "baseline.yaml")
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.gpu_memory_utilization) == (1, 8192, 0.9)
    assert cfg.chain("attention-decode") == cfg.chain("attention-decode-long") == ["v1"]
    assert cfg.chain("attention-prefill") == ["loop"] and cfg.chain("moe-dispatch") == ["gather"]


def test_loading_a_serve_config_imports_no_torch():
    """Every engine plugin's verify step loads the serve config in a fresh process: it must not pay torch's import
    (4 s on a GPU host), while `from engine import LLM` still works."""
    code = ("import sys; from engine.config import load_config; load_config(sys.argv[1]); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('torch', 'engine.')))")
    done = subprocess.run([sys.executable, "-c", code, str(CONFIGS / "baseline.yaml")], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, "-c", "from engine import LLM; print(LLM.__name__)"], capture_output=True,
                          text=True, cwd=Path(__file__).parents[2])
    assert done.stdout.strip() == "LLM", done.stderr
