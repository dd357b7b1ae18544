"""Model dimensions: the built-in presets and Hugging Face style ``config.json`` files.

Only metadata lives here, so a 35B-parameter preset can be described (and checked) without
allocating a single weight.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)
STATE_DTYPES = ("float32", "float16", "bfloat16")


def every_nth_full(num_layers: int, interval: int) -> tuple[str, ...]:
    """Hugging Face's ``full_attention_interval``: layer i is full attention when (i + 1) % interval == 0."""
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


@dataclass(frozen=True)
class ModelConfig:
    """A Qwen3-MoE / Qwen3.6 style decoder: each layer is full (gated GQA) attention or a Gated
    DeltaNet (linear attention) layer, as ``layer_types`` says, followed by the sparse MoE."""

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
    # None: every layer is full attention. Cycled when num_layers is longer (a depth override).
    layer_types: tuple[str, ...] | None = None
    linear_num_key_heads: int = 0  # Gated DeltaNet geometry; 0 where there are no such layers
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # the dtype the model keeps its Gated DeltaNet recurrent state in (config.json's ``mamba_ssm_dtype``:
    # float32 for Qwen3.5 and 3.6, whose accuracy was tuned so); None: the model's own dtype
    mamba_ssm_dtype: str | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_size * self.partial_rotary_factor)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The type of each of the ``num_layers`` layers."""
        types = self.layer_types or (FULL_ATTENTION,)
        return tuple(types[i % len(types)] for i in range(self.num_layers))

    @property
    def num_attention_layers(self) -> int:
        return self.layer_kinds.count(FULL_ATTENTION)

    @property
    def num_linear_layers(self) -> int:
        return self.layer_kinds.count(LINEAR_ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        """Has Gated DeltaNet layers, whose per-sequence state lives outside the KV cache."""
        return self.num_linear_layers > 0

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v of every linear-attention head."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def num_params(self) -> int:
        """Parameter count, to size memory before anything is allocated."""
        h, d = self.hidden_size, self.head_size
        q_out = self.num_heads * d * (2 if self.attn_output_gate else 1)
        attn = h * (q_out + 2 * self.num_kv_heads * d) + self.num_heads * d * h + 2 * d
        hv = self.linear_num_value_heads
        linear = (h * (self.linear_conv_dim + self.linear_value_dim + 2 * hv)  # in_proj_qkvz, in_proj_ba
                  + self.linear_conv_dim * self.linear_conv_kernel_dim + 2 * hv + self.linear_value_head_dim
                  + self.linear_value_dim * h)
        experts = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        ffn = experts + shared + 2 * h
        return (self.num_attention_layers * (attn + ffn) + self.num_linear_layers * (linear + ffn)
                + 2 * self.vocab_size * h + h)

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Only full-attention layers keep K and V per token."""
        return 2 * self.num_attention_layers * self.num_kv_heads * self.head_size * element_size

    def state_bytes_per_sequence(self, element_size: int, state_size: int) -> int:
        """What one running sequence holds in the Gated DeltaNet layers, whatever its length: the
        recurrent state [value heads, K, V] of ``state_size``-byte elements and the convolution's last
        kernel - 1 inputs."""
        recurrent = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * state_size
        conv = self.linear_conv_dim * (self.linear_conv_kernel_dim - 1) * element_size
        return self.num_linear_layers * (recurrent + conv)


PRESETS: dict[str, ModelConfig] = {
    # Small enough for CPU tests; a 512-token vocabulary holds the byte-level tokenizer.
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=32,
        num_experts=8, top_k=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        partial_rotary_factor=0.25, max_position_embeddings=4096,
    ),
    # tiny's hybrid sibling: Qwen3.6's pattern (three Gated DeltaNet layers, then full attention)
    # and its 2:1 value:key head ratio, small enough for CPU tests.
    "tiny-hybrid": ModelConfig(
        vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_size=32,
        num_experts=8, top_k=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        partial_rotary_factor=0.25, max_position_embeddings=4096, layer_types=every_nth_full(4, 4),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        mamba_ssm_dtype="float32",
    ),
    "small": ModelConfig(
        vocab_size=4096, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, head_size=64,
        num_experts=32, top_k=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        partial_rotary_factor=0.25, max_position_embeddings=32768,
    ),
    # Qwen3.6-35B-A3B (the text model of its config.json): 30 Gated DeltaNet and 10 gated attention
    # layers, three of the first between each two of the second.
    "qwen3.6-35b-a3b": ModelConfig(
        vocab_size=248_320, hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=2,
        head_size=256, num_experts=256, top_k=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, partial_rotary_factor=0.25, rope_theta=10_000_000.0,
        max_position_embeddings=262_144, layer_types=every_nth_full(40, 4),
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, mamba_ssm_dtype="float32",
    ),
    # The same dimensions with every layer full attention: the engine's model before it had Gated
    # DeltaNet layers, kept to compare against (4x the KV cache per token).
    "qwen3.6-35b-a3b-dense": ModelConfig(
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
    "linear_num_key_heads": "linear_num_key_heads",
    "linear_num_value_heads": "linear_num_value_heads",
    "linear_key_head_dim": "linear_key_head_dim",
    "linear_value_head_dim": "linear_value_head_dim",
    "linear_conv_kernel_dim": "linear_conv_kernel_dim",
}
# newer configs keep the rotary settings under rope_parameters
_HF_ROPE = {"rope_theta": "rope_theta", "partial_rotary_factor": "partial_rotary_factor"}


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
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    fields.update({field: rope[key] for key, field in _HF_ROPE.items() if rope.get(key) is not None})
    fields.update({field: raw[key] for key, field in _HF_OPTIONAL.items() if raw.get(key) is not None})
    fields.setdefault("head_size", raw["hidden_size"] // raw["num_attention_heads"])
    fields.setdefault("shared_expert_intermediate_size", 0)
    fields.setdefault("attn_output_gate", False)
    for key, value in fields.items():
        flag = key in ("attn_output_gate", "norm_topk_prob")
        if isinstance(value, bool) != flag or not isinstance(value, (int, float)):
            raise ModelConfigError("model", f"{path}: {key} must be a {'boolean' if flag else 'number'}, got {value!r}")
    fields["layer_types"] = _hf_layer_types(raw, path)
    ssm = raw.get("mamba_ssm_dtype")
    if ssm is not None and ssm not in STATE_DTYPES:
        raise ModelConfigError("model", f"{path}: mamba_ssm_dtype must be one of {', '.join(STATE_DTYPES)}, "
                                        f"got {ssm!r}")
    return ModelConfig(**fields, mamba_ssm_dtype=ssm)


def _hf_layer_types(raw: dict, path: Path) -> tuple[str, ...] | None:
    """``layer_types`` (one entry per layer), else ``full_attention_interval``, else None (all attention)."""
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ModelConfigError("model", f"{path}: layer_types must list {layers} layer types, got {types!r}")
        bad = next((t for t in types if t not in LAYER_TYPES), None)
        if bad is not None:
            raise ModelConfigError("model", f"{path}: layer_types: unknown layer type {bad!r}; "
                                            f"known: {', '.join(LAYER_TYPES)}")
        return tuple(types)
    interval = raw.get("full_attention_interval")
    if interval is not None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ModelConfigError("model", f"{path}: full_attention_interval must be a positive integer, "
                                            f"got {interval!r}")
        return every_nth_full(layers, interval)
    return None


def resolve_model(model: str, base_dir: Path | None, num_layers: int | None) -> ModelConfig:
    """A preset name or a path (file, or folder holding config.json), with the depth overridden."""
    where = model
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
        where = str(path)
    if num_layers is not None:
        cfg = replace(cfg, num_layers=num_layers)
    try:
        _check(cfg)
    except ModelConfigError as exc:
        if exc.key != "model":
            raise
        raise ModelConfigError("model", f"{where}: {exc}") from None
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
    if cfg.num_attention_layers == 0:
        raise ModelConfigError("num-layers", f"the first {cfg.num_layers} layers hold no full-attention layer "
                                             f"(layer types: {', '.join(cfg.layer_kinds)}); use more layers")
    if cfg.is_hybrid:
        _check_linear(cfg)


def _check_linear(cfg: ModelConfig) -> None:
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
             "linear_conv_kernel_dim")
    bad = next((n for n in names if getattr(cfg, n) < 1), None)
    if bad is not None:
        raise ModelConfigError("model", f"the model has linear_attention layers but {bad} is {getattr(cfg, bad)}")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ModelConfigError("model", f"linear_num_value_heads {cfg.linear_num_value_heads} is not a multiple "
                                        f"of linear_num_key_heads {cfg.linear_num_key_heads}")
