"""The serve config: one flat YAML mapping with vLLM's long option names.

``load_config`` turns a file or a dict into an ``EngineConfig``; anything wrong raises
``ConfigError`` naming the file and the key, before any weight or cache is allocated.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

import kernels
from engine.model_config import ModelConfig, ModelConfigError, resolve_model

# serve-config key -> kernel op it selects
KERNEL_KEYS = {
    "attention-decode": "paged_decode",
    "attention-decode-long": "paged_decode",
    "attention-prefill": "prefix_prefill",
    "moe-dispatch": "moe",
    "rms-norm": "rms_norm",
    "qk-norm-rope": "qk_norm_rope",
    "gdn-prefill": "gated_delta_rule",
    "gdn-decode": "gated_delta_rule",
}


class ConfigError(ValueError):
    """Bad serve config; the message starts with the file (or ``<dict>``) and the key."""

    def __init__(self, source: str, key: str, message: str):
        super().__init__(f"{source}: {key}: {message}")
        self.source, self.key = source, key


def _alias(name: str) -> str:
    return name.replace("_", "-")


VariantChain = Union[str, list[str]]


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, alias_generator=_alias, frozen=True)

    model: str = "tiny"
    num_layers: int | None = Field(None, ge=1)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: str = "auto"
    seed: int = 0

    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_memory: int | None = Field(None, ge=1)
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int | None = Field(None, ge=1)  # None: the model's max_position_embeddings

    attention_decode: VariantChain = "v1"
    attention_decode_long: VariantChain = "v2"
    decode_long_threshold: int = Field(8192, ge=1)
    attention_prefill: VariantChain = "pregather"
    prefill_block_m: int = Field(64, ge=1)
    prefill_block_n: int = Field(64, ge=1)
    prefill_num_warps: int = Field(4, ge=1)
    moe_dispatch: VariantChain = "sorted"
    gdn_prefill: VariantChain = "chunk"  # Gated DeltaNet layers (hybrid models only)
    gdn_decode: VariantChain = "recurrent"
    rms_norm: VariantChain = "torch"  # residual add + RMSNorm
    qk_norm_rope: VariantChain = "torch"  # per-head q/k RMSNorm + rotary embedding
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs; ignored on the CPU

    _source: str = PrivateAttr("<dict>")
    _model: ModelConfig | None = PrivateAttr(None)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        head, _, index = v.partition(":")
        if head not in ("auto", "cpu", "cuda") or (index and (head != "cuda" or not index.isdigit())):
            raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {v!r}")
        return v

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, v: int) -> int:
        if v < 1 or v > 512 or v & (v - 1):
            raise ValueError(f"must be a power of two up to 512, got {v}")
        return v

    @field_validator("attention_decode", "attention_decode_long", "attention_prefill", "moe_dispatch", "rms_norm",
                     "qk_norm_rope", "gdn_prefill", "gdn_decode")
    @classmethod
    def _chain(cls, v: VariantChain) -> VariantChain:
        if isinstance(v, list) and not v:
            raise ValueError("an empty list names no variant")
        return v

    # --- derived -----------------------------------------------------------------------------
    @property
    def source(self) -> str:
        return self._source

    @property
    def hf(self) -> ModelConfig:
        """The resolved model dimensions (preset or config.json, depth overridden)."""
        assert self._model is not None
        return self._model

    @property
    def vocab_size(self) -> int:
        return self.hf.vocab_size

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching runs: asked for, and the model has no Gated DeltaNet layer. A
        hybrid model's recurrent state after a prefix cannot be rebuilt from KV blocks, so a cache
        hit would still have to recompute the whole prefix in those layers (and so in every layer)."""
        return self.enable_prefix_caching and not self.hf.is_hybrid

    def chain(self, key: str) -> list[str]:
        """Variant names of a kernel key, in fallback order."""
        value = getattr(self, key.replace("-", "_"))
        return [value] if isinstance(value, str) else list(value)

    def prefill_kwargs(self) -> dict[str, int]:
        return {"block_m": self.prefill_block_m, "block_n": self.prefill_block_n,
                "num_warps": self.prefill_num_warps}

    def torch_device(self):
        import torch

        device = torch.device("cuda" if self.device == "auto" and torch.cuda.is_available()
                              else "cpu" if self.device == "auto" else self.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def torch_dtype(self):
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(self._source, key, message)


def load_config(path_or_dict: str | Path | dict[str, Any] | EngineConfig,
                overrides: dict[str, Any] | None = None) -> EngineConfig:
    """Parse and check a serve config, with ``overrides`` on top of its keys; relative model paths
    resolve against the file's folder."""
    if isinstance(path_or_dict, EngineConfig):
        if not overrides:
            return path_or_dict
        path_or_dict = path_or_dict.model_dump(by_alias=True, exclude_unset=True)
    if isinstance(path_or_dict, dict):
        source, base_dir, raw = "<dict>", None, path_or_dict
    else:
        path = Path(path_or_dict)
        source, base_dir = str(path), path.resolve().parent
        try:
            raw = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ConfigError(source, "-", f"cannot read: {exc.strerror or exc}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(source, "-", f"not valid YAML: {exc}") from exc
        if raw is None:
            raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(source, "-", f"expected a mapping of options, got {type(raw).__name__}")
    if overrides:
        raw = {**raw, **overrides}
    try:
        cfg = EngineConfig.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else "-"
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "value_error":
            msg = str(err["ctx"]["error"])
        else:
            msg = f"{err['msg']} (got {err['input']!r})"
        raise ConfigError(source, key, msg) from None
    try:
        model = resolve_model(cfg.model, base_dir, cfg.num_layers)
    except ModelConfigError as exc:
        raise ConfigError(source, exc.key, str(exc)) from None
    if cfg.max_model_len is None:
        cfg = cfg.model_copy(update={"max_model_len": model.max_position_embeddings})
    cfg._source, cfg._model = source, model
    _check(cfg)
    return cfg


def _check(cfg: EngineConfig) -> None:
    for key, op in KERNEL_KEYS.items():
        known = kernels.variants(op)
        for name in cfg.chain(key):
            if name not in known:
                raise cfg.error(key, f"unknown {op} variant {name!r}; known: {', '.join(known)}")
    if cfg.max_model_len > cfg.hf.max_position_embeddings:
        raise cfg.error("max-model-len", f"{cfg.max_model_len} exceeds the model's "
                        f"max_position_embeddings ({cfg.hf.max_position_embeddings})")
