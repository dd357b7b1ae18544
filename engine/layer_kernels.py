"""The kernels one decoder layer launches in a steady-state decode step, and their GPU time.

A decode step runs every layer on ``batch`` single-token rows; this runs one layer alone on such a
batch (random hidden states, state slots 0 to batch - 1, as a captured step reads them) so that a
layer's launches can be counted (``kernels.launches``: the profiler on CUDA, a dispatch count of the
ops that would launch elsewhere) and timed. Both the whole layer (norms, token mixing, MoE) and its
token mixer alone. Used by the GPU report and by the tests that hold a Gated DeltaNet layer's decode
step to its kernel count.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.attention_metadata import AttentionMetadata
from engine.state_cache import decode_only
from kernels.launches import kernels_launched


def decode_step(runner, index: int, batch: int, seed: int = 0) -> dict[str, Callable[[], object]]:
    """``layer`` and ``mixer``: thunks running layer ``index`` of ``runner``'s model (a Gated DeltaNet
    layer) on one decode step of ``batch`` sequences. The states of slots 0 to batch - 1 move on."""
    layer = runner.model.layers[index]
    if not hasattr(layer, "linear_attn"):
        raise ValueError(f"layer {index} is not a Gated DeltaNet layer")
    if batch > runner.num_state_slots:
        raise ValueError(f"batch {batch} exceeds the {runner.num_state_slots} state slots")
    gen = torch.Generator(device=runner.device).manual_seed(seed)
    hidden = runner.config.hf.hidden_size
    x = torch.randn(batch, hidden, generator=gen, device=runner.device).to(runner.dtype)
    residual = torch.randn(batch, hidden, generator=gen, device=runner.device).to(runner.dtype)
    slots = torch.arange(batch, device=runner.device)
    meta = AttentionMetadata(slot_blocks=None, slot_offsets=None, decode=None, decode_long=None, prefill=None,
                             state=decode_only(slots))
    rope = runner.model.rotary.angles(torch.zeros(batch, dtype=torch.int64, device=runner.device))

    @torch.no_grad()
    def whole():
        return layer(rope, x, residual, meta)

    @torch.no_grad()
    def mixer():
        return layer.linear_attn(x, meta)

    return {"layer": whole, "mixer": mixer}


def decode_kernels(runner, index: int, batch: int) -> dict[str, list[str]]:
    """The kernels of one decode step of layer ``index`` (``layer``) and of its token mixer alone
    (``mixer``), in launch order, after a warm-up (Triton compiles on first use)."""
    out = {}
    for part, fn in decode_step(runner, index, batch).items():
        fn()
        out[part] = kernels_launched(fn, runner.device)
    return out
