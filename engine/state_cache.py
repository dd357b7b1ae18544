"""The Gated DeltaNet layers' per-sequence state: one fixed-size slot per running sequence.

Unlike attention's KV cache, which grows a block at a time with the sequence, a linear-attention layer
summarises everything before it in a state of fixed size: the recurrent state [value heads, K, V] (in
``mamba-ssm-cache-dtype``: float32 for Qwen3.6 unless the serve config says otherwise) and the short
convolution's last ``kernel - 1`` inputs. So a sequence holds one slot (of ``max-num-seqs``) from
admission to finish or preemption, whatever its length; a slot is zeroed when its sequence computes its
first token, so a preempted sequence recomputes from scratch.

The scheduler owns which sequence has which slot (``StateSlots``); each layer owns its state
tensors, which the model runner allocates once (one row past the slots the scheduler hands out is a
scratch slot, which padding rows of a static decode step read and write) and never moves, so a
captured decode step keeps pointing at them; ``StateMetadata`` tells one forward pass which rows
read and write which slots.

Prefix caching stays off for hybrid models (``EngineConfig.prefix_caching``): the state after a
cached prefix is not stored anywhere, and rebuilding it means running that prefix through every
layer again, which is all a cache hit would save.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.sequence import Sequence


class StateSlots:
    """Which slot each running sequence holds; as many slots as sequences may run at once."""

    def __init__(self, num_slots: int):
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            raise RuntimeError(f"{seq.request_id} already holds state slot {seq.state_slot}")
        if not self._free:
            raise RuntimeError("no free state slot: more running sequences than max-num-seqs")
        seq.state_slot = self._free.pop()

    def free(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self._free.append(seq.state_slot)
            seq.state_slot = None


@dataclass
class StateMetadata:
    """Rows ``0:num_decode`` of the batch are single tokens (decodes, and one-token prompts or
    chunks); the rest are prefill chunks, packed per sequence as ``prefill_cu_seqlens`` says."""

    num_decode: int
    decode_slots: torch.Tensor | None  # int64 [num_decode]: device-side, so decode needs no host sync
    prefill_slots: torch.Tensor | None  # int64 [prefill seqs]
    prefill_cu_seqlens: torch.Tensor | None  # int32 [prefill seqs + 1], relative to row num_decode
    fresh_slots: torch.Tensor | None  # slots of sequences computing their first token: zeroed first


def state_metadata(seqs: list[Sequence], num_new: list[int], num_decode: int,
                   tensor: Callable[[list, torch.dtype], torch.Tensor]) -> StateMetadata:
    """``seqs`` in batch order with their token counts; the first ``num_decode`` have one token.
    ``tensor(values, dtype)`` puts a list on the device (the model runner's pinned staging)."""
    def device_tensor(values, dtype=torch.int64):
        return tensor(values, dtype) if values else None

    slots = [s.state_slot for s in seqs]
    if None in slots:
        raise RuntimeError("a scheduled sequence of a hybrid model holds no state slot")
    cu = [0]
    for n in num_new[num_decode:]:
        cu.append(cu[-1] + n)
    return StateMetadata(num_decode=num_decode, decode_slots=device_tensor(slots[:num_decode]),
                         prefill_slots=device_tensor(slots[num_decode:]),
                         prefill_cu_seqlens=device_tensor(cu, torch.int32) if len(cu) > 1 else None,
                         fresh_slots=device_tensor([s.state_slot for s in seqs if s.num_computed_tokens == 0]))


def decode_only(decode_slots: torch.Tensor) -> StateMetadata:
    """A steady-state decode step: one token per row, every sequence past its first token (no slot
    to zero, no prefill), slots read from a device tensor, as a captured CUDA graph replays it."""
    return StateMetadata(num_decode=decode_slots.shape[0], decode_slots=decode_slots, prefill_slots=None,
                         prefill_cu_seqlens=None, fresh_slots=None)


def allocate_states(layers, num_slots: int, dtype: torch.dtype, state_dtype: torch.dtype,
                    device: torch.device) -> int:
    """Give every Gated DeltaNet layer zeroed state for ``num_slots`` sequences: the convolution's in the model's
    ``dtype``, the recurrent one in ``state_dtype``; returns the bytes."""
    total = 0
    for layer in layers:
        layer.conv_state = layer.ssm_state = None
    for layer in layers:
        layer.conv_state = torch.zeros(num_slots, layer.conv_dim, layer.kernel_size - 1, dtype=dtype, device=device)
        layer.ssm_state = torch.zeros(num_slots, layer.num_v_heads, layer.head_k, layer.head_v,
                                      dtype=state_dtype, device=device)
        total += sum(t.numel() * t.element_size() for t in (layer.conv_state, layer.ssm_state))
    return total
