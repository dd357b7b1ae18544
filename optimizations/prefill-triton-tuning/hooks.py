"""Precondition for prefill-triton-tuning on the engine: its launch parameters only matter where the
engine would run the Triton prefill: the serve config lists it, and the device is a GPU or Triton's
interpreter was asked for (otherwise the engine refuses Triton kernels on the CPU and falls back)."""
from __future__ import annotations

from pathlib import Path


def triton_prefill_in_use(root: Path, serve_config: str) -> bool:
    import kernels
    from engine.config import load_config

    config = load_config(Path(root) / serve_config)
    listed = "triton" in config.chain("attention-prefill")
    runs = config.torch_device().type == "cuda" or kernels.INTERPRET_REQUESTED
    print(f"attention-prefill lists triton: {listed}; device: {config.torch_device()}; "
          f"TRITON_INTERPRET requested: {kernels.INTERPRET_REQUESTED}")
    return listed and runs
