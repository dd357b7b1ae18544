"""Precondition on the engine: the model has Gated DeltaNet layers (a hybrid model, e.g. qwen3.6-35b-a3b or
tiny-hybrid) and keeps their recurrent state in more than 16 bits; elsewhere the key changes nothing."""
from __future__ import annotations

from pathlib import Path


def wide_state(root: Path, serve_config: str) -> bool:
    from engine.config import load_config

    cfg = load_config(Path(root) / serve_config)
    dtype = cfg.state_dtype()
    wide = cfg.hf.is_hybrid and dtype.itemsize > 2
    print(f"model {cfg.model} has Gated DeltaNet layers: {cfg.hf.is_hybrid}; their recurrent state: "
          f"{str(dtype).removeprefix('torch.')}")
    return wide
