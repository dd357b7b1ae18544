"""Precondition for cuda-graphs on the engine: graphs are captured only on a GPU; on the CPU the key
is ignored, so staging it there would measure nothing."""
from __future__ import annotations

from pathlib import Path


def engine_on_cuda(root: Path, serve_config: str) -> bool:
    from engine.config import load_config

    device = load_config(Path(root) / serve_config).torch_device()
    print(f"engine device: {device}")
    return device.type == "cuda"
