"""What one forward pass needs to know about its batch, built once per step by the model runner.

Tokens are ordered short decodes, long decodes, then prefill chunks, so each attention kernel
works on one contiguous slice of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.state_cache import StateMetadata


@dataclass
class DecodeGroup:
    """Rows ``start:end`` of the batch, one token each, attending to ``seq_lens`` cached tokens."""

    start: int
    end: int
    block_tables: torch.Tensor  # int32 [rows, max_blocks]
    seq_lens: torch.Tensor  # int32 [rows], including the new token


@dataclass
class PrefillGroup:
    """Rows ``start:`` of the batch: new tokens of several sequences, each after its cached context."""

    start: int
    block_tables: torch.Tensor  # int32 [seqs, max_context_blocks]
    query_start_loc: torch.Tensor  # int32 [seqs + 1], relative to ``start``
    context_lens: torch.Tensor  # int32 [seqs]


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # int64 [tokens]: cache block of each new token's K/V
    slot_offsets: torch.Tensor  # int64 [tokens]: its position inside the block
    decode: DecodeGroup | None
    decode_long: DecodeGroup | None
    prefill: PrefillGroup | None
    state: StateMetadata | None = None  # Gated DeltaNet slots (hybrid models only)
