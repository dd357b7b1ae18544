"""Verify for max-num-seqs-256: does the KV cache hold `seqs` sequences of `tokens` tokens?

The seed's arithmetic, from the model's own config rather than a constant:
seqs x tokens x KV bytes per token (2 x attention layers x KV heads x head size x element size)
must fit in the memory left for the KV cache. A hybrid model (Gated DeltaNet layers) also holds a
fixed-size state per sequence: seqs x that state comes on top. When an input is missing the check
fails and says which one, rather than passing unverified.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1}


def report(seqs: int, tokens: int, per_token: int, available: float, where: str, per_seq: int = 0) -> bool:
    """``per_seq``: state bytes each sequence holds whatever its length (linear-attention layers)."""
    need = seqs * (tokens * per_token + per_seq)
    verdict = "fits" if need < available else "does NOT fit"
    state = f" + {per_seq / 2**20:.1f} MiB/sequence of linear-attention state" if per_seq else ""
    print(f"KV cache for {seqs} x {tokens} tokens x {per_token / 1024:.1f} KiB/token{state} = {need / GIB:.2f} GiB "
          f"{verdict} in {available / GIB:.2f} GiB ({where})")
    return need < available


def kv_cache_fits_engine(root: Path, serve_config: str, seqs: int, tokens: int) -> bool:
    """The engine's serve config: cache memory as the engine itself will size it."""
    import torch
    from engine.config import load_config
    from engine.model_runner import DEFAULT_CPU_KV_CACHE_MEMORY

    cfg = load_config(root / serve_config)
    element = torch.empty((), dtype=cfg.torch_dtype()).element_size()
    per_token = cfg.hf.kv_bytes_per_token(element)
    if cfg.kv_cache_memory is not None:
        return report(seqs, tokens, per_token, cfg.kv_cache_memory, "kv-cache-memory")
    device = cfg.torch_device()
    if device.type != "cuda":
        return report(seqs, tokens, per_token, DEFAULT_CPU_KV_CACHE_MEMORY, "the engine's CPU default")
    total = torch.cuda.get_device_properties(device).total_memory
    weights = cfg.hf.num_params() * element
    # the engine allocates max-num-seqs state slots (and a scratch one for the padding rows of its decode
    # graphs) before it sizes the KV cache from what is left
    states = (cfg.max_num_seqs + 1) * cfg.hf.state_bytes_per_sequence(element, cfg.state_dtype().itemsize)
    return report(seqs, tokens, per_token, total * cfg.gpu_memory_utilization - weights - states,
                  f"{cfg.gpu_memory_utilization} x {total / GIB:.1f} GiB less {weights / GIB:.1f} GiB of weights "
                  f"and {states / GIB:.1f} GiB of linear-attention state slots")


def kv_cache_fits_vllm(root: Path, serve_config: str, seqs: int, tokens: int) -> bool:
    """A `vllm serve --config` YAML: the model's HF config.json, and the memory vLLM may give the cache."""
    options = yaml.safe_load((root / serve_config).read_text()) or {}
    model = os.environ.get("ORCHESTRATOR_VLLM_MODEL") or options.get("model")
    if not model:
        return not_verifiable(f"{serve_config} names no model")
    folder = model_folder(str(model), root)
    if folder is None:
        return not_verifiable(f"the config.json of model {model!r} is neither a local folder nor in the "
                              "Hugging Face cache; download it (huggingface-cli download) or give a local path")
    hf = json.loads((folder / "config.json").read_text())
    hf = hf.get("text_config", hf)
    per_token, per_seq = kv_bytes_per_token(hf, options), state_bytes_per_sequence(hf, options)
    if options.get("kv-cache-memory-bytes"):
        return report(seqs, tokens, per_token, float(options["kv-cache-memory-bytes"]), "kv-cache-memory-bytes",
                      per_seq)
    total = gpu_memory()
    if total is None:
        return not_verifiable("no GPU is visible and the serve config sets no kv-cache-memory-bytes")
    weights, what = weight_bytes(folder, hf)
    if not weights:
        return not_verifiable(f"no *.safetensors weights in {folder} to subtract from GPU memory, and {what}")
    util = float(options.get("gpu-memory-utilization", 0.9))
    return report(seqs, tokens, per_token, total * util - weights,
                  f"{util} x {total / GIB:.1f} GiB less {weights / GIB:.1f} GiB of {what}", per_seq)


def weight_bytes(folder: Path, hf: dict) -> tuple[float, str]:
    """(bytes the weights take on the GPU, what they are): their files' size, else, for a folder
    with no weight files (served with --load-format dummy: random weights of the same shapes), the
    parameter count of its config.json at the model's dtype."""
    files = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    if files:
        return files, "weights"
    from engine.model_config import ModelConfigError, from_hf_config

    try:
        params = from_hf_config(folder / "config.json").num_params()
    except ModelConfigError as exc:
        return 0, f"its parameters cannot be counted: {exc}"
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    return params * DTYPE_BYTES.get(dtype, 2), f"weights ({params / 1e9:.1f}B parameters of config.json; no weight files)"


def not_verifiable(why: str) -> bool:
    print(f"not verifiable: {why}")
    return False


def attention_layers(hf: dict) -> int:
    """Only full-attention layers keep a KV cache (hybrid models list their layer types)."""
    layers = hf["num_hidden_layers"]
    if isinstance(hf.get("layer_types"), list):
        return sum(1 for t in hf["layer_types"] if t == "full_attention")
    if hf.get("full_attention_interval"):
        return layers // int(hf["full_attention_interval"])
    return layers


def state_bytes_per_sequence(hf: dict, options: dict) -> int:
    """Linear-attention (Gated DeltaNet) layers: the recurrent state [value heads, K, V] in
    ``mamba-ssm-cache-dtype``, where auto is the model's ``mamba_ssm_dtype`` or else its cache dtype (vLLM's
    rule), and the convolution's last kernel - 1 inputs."""
    linear = hf["num_hidden_layers"] - attention_layers(hf)
    if not linear or not hf.get("linear_num_value_heads"):
        return 0
    hv, dk, dv = hf["linear_num_value_heads"], hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    conv_dim = 2 * hf["linear_num_key_heads"] * dk + hv * dv
    conv = DTYPE_BYTES.get(cache_dtype(hf, options), 2)
    ssm_dtype = options.get("mamba-ssm-cache-dtype", "auto")
    ssm = DTYPE_BYTES.get(str(hf.get("mamba_ssm_dtype") if ssm_dtype == "auto" else ssm_dtype), conv)
    return linear * (hv * dk * dv * ssm + conv_dim * (hf.get("linear_conv_kernel_dim", 4) - 1) * conv)


def cache_dtype(hf: dict, options: dict) -> str:
    dtype = options.get("kv-cache-dtype", "auto")
    if dtype == "auto":
        dtype = options.get("dtype", "auto")
    if dtype == "auto":
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    return dtype


def kv_bytes_per_token(hf: dict, options: dict) -> int:
    layers = attention_layers(hf)
    head_size = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads", hf["num_attention_heads"])
    dtype = cache_dtype(hf, options)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {dtype!r}")
    return 2 * layers * kv_heads * head_size * DTYPE_BYTES[dtype]


def model_folder(model: str, base: Path) -> Path | None:
    """A local folder holding config.json, or the newest snapshot of `org/name` in the HF cache."""
    local = Path(model).expanduser()
    local = local if local.is_absolute() else base / local
    if (local / "config.json").is_file():
        return local
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub")
    snapshots = hub.expanduser() / f"models--{model.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return found[-1].parent if found else None


def gpu_memory() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory
