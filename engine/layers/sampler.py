"""Greedy sampling: the engine's outputs are a deterministic function of its weights."""
from __future__ import annotations

import torch


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit, the first on ties. Over the logits' own dtype: a 16-bit float widens
    to float32 exactly, so a float32 copy first (a [batch, vocab] write and read) picks the same index."""
    return logits.argmax(dim=-1)


def greedy(logits: torch.Tensor) -> list[int]:
    return greedy_ids(logits).tolist()
