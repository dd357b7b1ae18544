"""What the Triton variants share: interpreter fallback on machines without CUDA, dot precision.

Triton decides between compiling and interpreting a kernel when the kernel is defined, from
TRITON_INTERPRET; import this module before defining one.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # no GPU to compile for: run kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402


def dot_precision(dtype: torch.dtype) -> str:
    """float32 operands use exact fp32 dots (not tf32) so they meet the float32 tolerance."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few programs per op still exercise the split and reduce paths


def pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


import triton.language as tl  # noqa: E402


@triton.jit
def paged_tile(n0, j, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """(block-table column, slot in block, first token of the slot's block) for tokens ``n0 + j``.

    ``n0`` is a multiple of BLOCK_N. Built from ``j = arange(BLOCK_N)`` alone so that Triton's axis
    analysis sees runs of contiguous slots and vectorises the cache loads; masks made from the
    third value are constant within a block, which keeps those loads vectorised too.
    """
    if BLOCK_N >= BLOCK_SIZE:
        col = n0 // BLOCK_SIZE + j // BLOCK_SIZE
        slot = j % BLOCK_SIZE
        first = n0 + (j // BLOCK_SIZE) * BLOCK_SIZE
    else:
        col = n0 // BLOCK_SIZE + j * 0
        slot = n0 % BLOCK_SIZE + j
        first = n0 - n0 % BLOCK_SIZE + j * 0
    return col, slot, first
