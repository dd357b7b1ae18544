"""Precondition on the engine: the Gated DeltaNet kernels only run for a model that has such layers
(a hybrid model, e.g. qwen3.6-35b-a3b or tiny-hybrid), and the engine only runs Triton kernels on a
GPU or when Triton's interpreter was asked for (elsewhere it falls back, and nothing changes)."""
from __future__ import annotations

from pathlib import Path


def triton_gdn_in_use(root: Path, serve_config: str) -> bool:
    from engine.config import load_config
    from engine.kernel_choice import gdn_triton_runs

    runs, why = gdn_triton_runs(load_config(Path(root) / serve_config))
    print(why)
    return runs
