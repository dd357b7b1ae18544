"""Model dimensions: the built-in presets and Hugging Face style ``config.json`` files.

Only metadata lives here, so a 35B-parameter preset can be described (and checked) without
allocating a single weight.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    """A Qwen3-MoE style decoder where every layer is full attention."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert
    partial_rotary_factor: float = 1.0
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    attn_output_gate: bool = True  # Qwen3-Next/3.6: q_proj also yields a sigmoid gate per head
    norm_topk_prob: bool = True

    @property
    def rotary_dim(self) -> int:
        return int(self.head_size * self.partial_rotary_factor)

    def num_params(self) -> int:
        """Parameter count, to size memory before anything is allocated."""
        h, d = self.hidden_size, self.head_size
        q_out = self.num_heads * d * (2 if self.attn_output_gate else 1)
        attn = h * (q_out + 2 * self.num_kv_heads * d) + self.num_heads * d * h + 2 * d
        experts = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        layer = attn + experts + shared + 2 * h
        return self.num_layers * layer + 2 * self.vocab_size * h + h

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * element_size


PRESETS: dict[str, ModelConfig] = {
    # Small enough for CPU tests; a 512-token vocabulary holds the byte-level tokenizer.
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=32,
        num_experts=8, top_k=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        partial_rotary_factor=0.25, max_position_embeddings=4096,
    ),
    "small": ModelConfig(
        vocab_size=4096, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, head_size=64,
        num_experts=32, top_k=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        partial_rotary_factor=0.25, max_position_embeddings=32768,
    ),
    # Qwen3.6-35B-A3B's dimensions (its Gated DeltaNet layers are full attention here).
    "qwen3.6-35b-a3b": ModelConfig(
        vocab_size=248_320, hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=2,
        head_size=256, num_experts=256, top_k=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, partial_rotary_factor=0.25, rope_theta=10_000_000.0,
        max_position_embeddings=262_144,
    ),
}

# config.json key -> ModelConfig field; the first group is required.
_HF_REQUIRED = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "num_experts": "num_experts",
    "num_experts_per_tok": "top_k",
    "moe_intermediate_size": "moe_intermediate_size",
}
_HF_OPTIONAL = {
    "head_dim": "head_size",
    "shared_expert_intermediate_size": "shared_expert_intermediate_size",
    "partial_rotary_factor": "partial_rotary_factor",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
    "attn_output_gate": "attn_output_gate",
    "norm_topk_prob": "norm_topk_prob",
}


class ModelConfigError(ValueError):
    """A model reference that cannot be turned into dimensions; ``key`` names the culprit."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def from_hf_config(path: Path) -> ModelConfig:
    """Read a Hugging Face ``config.json`` (multimodal ones keep the LM under ``text_config``)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError("model", f"cannot read model config {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError("model", f"{path}: expected a JSON object")
    raw = raw.get("text_config", raw)
    missing = [k for k in _HF_REQUIRED if k not in raw]
    if missing:
        raise ModelConfigError("model", f"{path}: missing key {missing[0]!r}")
    fields = {field: raw[key] for key, field in _HF_REQUIRED.items()}
    fields.update({field: raw[key] for key, field in _HF_OPTIONAL.items() if raw.get(key) is not None})
    fields.setdefault("head_size", raw["hidden_size"] // raw["num_attention_heads"])
    fields.setdefault("shared_expert_intermediate_size", 0)
    fields.setdefault("attn_output_gate", False)
    for key, value in fields.items():
        flag = key in ("attn_output_gate", "norm_topk_prob")
        if isinstance(value, bool) != flag or not isinstance(value, (int, float)):
            raise ModelConfigError("model", f"{path}: {key} must be a {'boolean' if flag else 'number'}, got {value!r}")
    return ModelConfig(**fields)


def resolve_model(model: str, base_dir: Path | None, num_layers: int | None) -> ModelConfig:
    """A preset name or a path (file, or folder holding config.json), with the depth overridden."""
    if model in PRESETS:
        cfg = PRESETS[model]
    else:
        path = Path(model)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ModelConfigError(
                "model", f"{model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing config.json")
        cfg = from_hf_config(path)
    if num_layers is not None:
        cfg = replace(cfg, num_layers=num_layers)
    _check(cfg)
    return cfg


def _check(cfg: ModelConfig) -> None:
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelConfigError("model", f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}")
    if not 0 < cfg.top_k <= cfg.num_experts:
        raise ModelConfigError("model", f"top_k {cfg.top_k} must be in 1..num_experts ({cfg.num_experts})")
    if cfg.rotary_dim % 2:
        raise ModelConfigError("model", f"rotary dim {cfg.rotary_dim} must be even")
    if cfg.head_size % 8:
        raise ModelConfigError("model", f"head size {cfg.head_size} must be a multiple of 8 (the KV cache's x)")
    if cfg.num_layers < 1:
        raise ModelConfigError("num-layers", f"num-layers must be at least 1, got {cfg.num_layers}")
