"""Greedy sampling: the engine's outputs are a deterministic function of its weights."""
from __future__ import annotations

import torch


def greedy(logits: torch.Tensor) -> list[int]:
    return logits.float().argmax(dim=-1).tolist()
