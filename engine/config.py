"""The serve config: one flat YAML mapping with vLLM's long option names.

``load_config`` turns a file or a dict into an ``EngineConfig``; anything wrong raises
``ConfigError`` naming the file and the key, before any weight or cache is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Union

import yaml

import kernels
from engine.model_config import ModelConfig, ModelConfigError, resolve_model

# serve-config key -> kernel op it selects, or the ops one variant name selects together
KERNEL_KEYS: dict[str, str | tuple[str, ...]] = {
    "attention-decode": "paged_decode",
    "attention-decode-long": "paged_decode",
    "attention-prefill": "prefix_prefill",
    "moe-dispatch": "moe",
    "rms-norm": "rms_norm",
    "qk-norm-rope": "qk_norm_rope",
    "gdn-prefill": "gated_delta_rule",
    "gdn-decode": "gated_delta_rule",
    "gdn-fused": ("causal_conv1d", "gdn_gating", "rms_norm_gated"),  # the Gated DeltaNet layer's small ops
}


def key_ops(key: str) -> tuple[str, ...]:
    """The kernel ops a serve-config kernel key selects."""
    ops = KERNEL_KEYS[key]
    return (ops,) if isinstance(ops, str) else ops


def key_variants(key: str) -> list[str]:
    """The variant names a kernel key takes: those every one of its ops has."""
    ops = key_ops(key)
    return [v for v in kernels.variants(ops[0]) if all(v in kernels.variants(op) for op in ops[1:])]


class ConfigError(ValueError):
    """Bad serve config; the message starts with the file (or ``<dict>``) and the key."""

    def __init__(self, source: str, key: str, message: str):
        super().__init__(f"{source}: {key}: {message}")
        self.source, self.key = source, key


def _alias(name: str) -> str:
    return name.replace("_", "-")


VariantChain = Union[str, list[str]]
DTYPES = ("auto", "float32", "float16", "bfloat16")


def _key(kind, default, **rules):
    """A serve-config key: its kind (a type, or a tuple of allowed values), default and rules
    (bounds ``ge``, ``gt``, ``le``; ``optional``: None allowed; ``check``: value -> problem or None)."""
    return field(default=default, metadata={"kind": kind, **rules})


def _device(v: str) -> str | None:
    head, _, index = v.partition(":")
    if head not in ("auto", "cpu", "cuda") or (index and (head != "cuda" or not index.isdigit())):
        return f"expected auto, cpu, cuda or cuda:N, got {v!r}"
    return None


def _power_of_two(v: int) -> str | None:
    if v < 1 or v > 512 or v & (v - 1):
        return f"must be a power of two up to 512, got {v}"
    return None


@dataclass(frozen=True)
class EngineConfig:
    """One serve config, checked by ``load_config``. A plain dataclass, so the engine and its GPU
    reports need nothing beyond torch and PyYAML."""

    model: str = _key(str, "tiny")
    num_layers: int | None = _key(int, None, ge=1, optional=True)
    dtype: str = _key(DTYPES, "auto")
    device: str = _key(str, "auto", check=_device)
    seed: int = _key(int, 0)

    max_num_seqs: int = _key(int, 256, ge=1)
    max_num_batched_tokens: int = _key(int, 8192, ge=1)
    gpu_memory_utilization: float = _key(float, 0.9, gt=0.0, le=1.0)
    kv_cache_memory: int | None = _key(int, None, ge=1, optional=True)
    block_size: int = _key(int, 16, check=_power_of_two)
    enable_prefix_caching: bool = _key(bool, True)
    max_model_len: int | None = _key(int, None, ge=1, optional=True)  # None: the model's max_position_embeddings

    attention_decode: VariantChain = _key(VariantChain, "v1")
    attention_decode_long: VariantChain = _key(VariantChain, "v2")
    decode_long_threshold: int = _key(int, 8192, ge=1)
    attention_prefill: VariantChain = _key(VariantChain, "pregather")
    prefill_block_m: int = _key(int, 64, ge=1)
    prefill_block_n: int = _key(int, 64, ge=1)
    prefill_num_warps: int = _key(int, 4, ge=1)
    moe_dispatch: VariantChain = _key(VariantChain, "sorted")
    gdn_prefill: VariantChain = _key(VariantChain, "chunk")  # Gated DeltaNet layers (hybrid models only)
    gdn_decode: VariantChain = _key(VariantChain, "recurrent")
    gdn_fused: VariantChain = _key(VariantChain, "torch")  # their convolution, gates and gated norm
    # their recurrent state's dtype (vLLM's option): auto is what the model declares (Qwen3.6: float32), else the
    # model's dtype. A decode step reads and writes every running sequence's state in every such layer: Qwen3.6's
    # 2 MiB a sequence and layer in float32 make 25 GB a step at 200 sequences, against 68 GB of expert weights
    mamba_ssm_cache_dtype: str = _key(DTYPES, "auto")
    rms_norm: VariantChain = _key(VariantChain, "torch")  # residual add + RMSNorm
    qk_norm_rope: VariantChain = _key(VariantChain, "torch")  # per-head q/k RMSNorm + rotary embedding
    cuda_graphs: bool = _key(bool, True)  # decode steps replayed from CUDA graphs; ignored on the CPU
    # a decode step on the graphs' buffers is scheduled and filled while the one before runs, its inputs taken from
    # the tokens that step leaves on the device (vLLM's --async-scheduling): the host's share of a step hidden
    async_scheduling: bool = _key(bool, False)
    # engine.server: tokens a streamed response sends together after its first (vLLM's --stream-interval): the HTTP
    # side, which shares the interpreter with the engine's step loop, handles that many times fewer messages
    stream_interval: int = _key(int, 1, ge=1)

    # set by load_config (``_attach``): the file or "<dict>", the resolved model, the mapping read
    _source: ClassVar[str] = "<dict>"
    _model: ClassVar[ModelConfig | None] = None
    _raw: ClassVar[dict[str, Any]] = {}

    def as_dict(self) -> dict[str, Any]:
        """Every setting by field name (``max_num_seqs``), defaults included."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def updated(self, **update) -> EngineConfig:
        """A copy with ``update`` (field names) applied, resolved model and source kept; unchecked,
        like a field the caller computed itself."""
        cfg = replace(self, **update)
        _attach(cfg, self._source, self._model, {**self._raw, **{_alias(k): v for k, v in update.items()}})
        return cfg

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

    def graphs_on_gpu(self) -> bool:
        """Whether decode steps replay from CUDA graphs here (what async-scheduling overlaps)."""
        return self.cuda_graphs and self.torch_device().type == "cuda"

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

    def state_dtype(self):
        """The Gated DeltaNet recurrent state's torch dtype (``mamba-ssm-cache-dtype``)."""
        import torch

        name = self.mamba_ssm_cache_dtype if self.mamba_ssm_cache_dtype != "auto" else self.hf.mamba_ssm_dtype
        return getattr(torch, name) if name else self.torch_dtype()

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(self._source, key, message)


def load_config(path_or_dict: str | Path | dict[str, Any] | EngineConfig,
                overrides: dict[str, Any] | None = None) -> EngineConfig:
    """Parse and check a serve config, with ``overrides`` on top of its keys; relative model paths
    resolve against the file's folder."""
    if isinstance(path_or_dict, EngineConfig):
        if not overrides:
            return path_or_dict
        path_or_dict = dict(path_or_dict._raw)
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
    values = _validate(raw, source)
    try:
        model = resolve_model(values["model"], base_dir, values["num_layers"])
    except ModelConfigError as exc:
        raise ConfigError(source, exc.key, str(exc)) from None
    if values["max_model_len"] is None:
        values["max_model_len"] = model.max_position_embeddings
    cfg = EngineConfig(**values)
    _attach(cfg, source, model, raw)
    _check(cfg)
    return cfg


def _attach(cfg: EngineConfig, source: str, model: ModelConfig, raw: dict[str, Any]) -> None:
    """What a config knows beyond its keys: where it came from, its model, the mapping it was read from."""
    object.__setattr__(cfg, "_source", source)
    object.__setattr__(cfg, "_model", model)
    object.__setattr__(cfg, "_raw", dict(raw))


def _validate(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Field name -> value for every key, defaults filled in; ``ConfigError`` on the first bad key.
    Types are strict, as YAML gives them: ``"4"`` is not an integer, ``true`` is not a number."""
    known = {_alias(f.name): f for f in fields(EngineConfig)}
    for key in raw:
        if key not in known:
            raise ConfigError(source, str(key), "unknown key")
    values = {}
    for key, f in known.items():
        value = raw.get(key, f.default)
        problem = _problem(f.metadata, value) if key in raw else None
        if problem is not None:
            raise ConfigError(source, key, problem)
        if f.metadata["kind"] is float and value is not None:
            value = float(value)
        values[f.name] = list(value) if isinstance(value, list) else value
    return values


def _problem(rules: dict, value: Any) -> str | None:
    """Why ``value`` does not fit a key's ``rules``, or None."""
    kind = rules["kind"]
    if value is None and rules.get("optional"):
        return None
    if kind is VariantChain:
        if isinstance(value, list) and not value:
            return "an empty list names no variant"
        if not (isinstance(value, str) or isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return f"Input should be a variant name or a list of them (got {value!r})"
        return None
    if isinstance(kind, tuple):
        if value not in kind:
            return f"Input should be {', '.join(map(repr, kind[:-1]))} or {kind[-1]!r} (got {value!r})"
        return None
    if isinstance(value, bool) and kind is not bool or not isinstance(value, (int, float) if kind is float else kind):
        name = {int: "a valid integer", float: "a valid number", bool: "a valid boolean", str: "a valid string"}[kind]
        return f"Input should be {name} (got {value!r})"
    for rule, words in (("ge", "greater than or equal to"), ("gt", "greater than"), ("le", "less than or equal to")):
        bound = rules.get(rule)
        if bound is not None and not (value >= bound if rule == "ge" else value > bound if rule == "gt"
                                      else value <= bound):
            return f"Input should be {words} {bound} (got {value!r})"
    check = rules.get("check")
    return check(value) if check is not None else None


def _check(cfg: EngineConfig) -> None:
    for key in KERNEL_KEYS:
        known, ops = key_variants(key), key_ops(key)
        for name in cfg.chain(key):
            if name not in known:
                what = ops[0] if len(ops) == 1 else "/".join(ops)
                raise cfg.error(key, f"unknown {what} variant {name!r}; known: {', '.join(known)}")
    if cfg.max_model_len > cfg.hf.max_position_embeddings:
        raise cfg.error("max-model-len", f"{cfg.max_model_len} exceeds the model's "
                        f"max_position_embeddings ({cfg.hf.max_position_embeddings})")
