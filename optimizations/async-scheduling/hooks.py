"""Preconditions of the async-scheduling plugin on the engine target."""
from __future__ import annotations

from pathlib import Path


def graphs_on_cuda(root: Path, serve_config: str) -> bool:
    """The engine overlaps only the decode steps it replays from CUDA graphs: a GPU, and cuda-graphs on."""
    from engine.config import load_config

    config = load_config(Path(root) / serve_config)
    print(f"engine device: {config.torch_device()}, cuda-graphs: {config.cuda_graphs}")
    return config.graphs_on_gpu()
