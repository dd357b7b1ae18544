"""What the Triton variants share: interpreter fallback on machines without CUDA, dot precision,
the device's limits that launch configurations are chosen against.

Triton decides between compiling and interpreting a kernel when the kernel is defined, from
TRITON_INTERPRET; import this module before defining one.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Callable

import torch

if not torch.cuda.is_available():  # no GPU to compile for: run kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402


def jit_per_step(*names: str):
    """``triton.jit`` with one compiled variant whatever the integer arguments ``names`` hold: token, row and
    sequence counts and block-table widths that change from step to step. Triton would key each by whether it
    is 1 and whether 16 divides it, and compile each new combination the first time a served step reaches it,
    inside that step (engine/warm_up.py warms the variants that remain: the launch configurations chosen by
    size)."""
    kw = {"do_not_specialize": list(names)}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kw["do_not_specialize_on_alignment"] = list(names)
    return triton.jit(**kw)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 operands use exact fp32 dots (not tf32) so they meet the float32 tolerance."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few programs per op still exercise the split and reduce paths


# An H200's (and H100's) shared memory per program, in bytes: what the interpreter plans for, so
# that CPU tests choose the launch configurations a Hopper GPU would run.
HOPPER_SHARED_MEM = 232448


def max_shared_mem(device: torch.device) -> int:
    """Shared memory one program may use on ``device`` (the opt-in maximum per block), in bytes."""
    if device.type != "cuda":
        return HOPPER_SHARED_MEM
    return _cuda_shared_mem(torch.device(device).index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_shared_mem(index: int) -> int:
    try:  # what Triton itself checks a compiled kernel against before launching it
        from triton.runtime import driver
        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # another driver layout: torch reads the same attribute
        return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # older layouts
    from triton.runtime.autotuner import OutOfResources  # type: ignore[no-redef]


class FirstThatFits:
    """Launches the first of several configurations, in order of preference, that the device accepts.

    The configurations are chosen from estimates of their shared memory; should a compiled kernel
    still need more than the device has (Triton raises ``OutOfResources`` before launching anything),
    the next one is tried, and the one that ran is remembered (per list of configurations and
    ``key``) so that later calls, and CUDA graph captures, go straight to it.
    """

    def __init__(self) -> None:
        self.chosen: dict = {}

    def launch(self, configs: list[dict], run: Callable[[dict], object], key=()):
        if not configs:
            raise ValueError("no launch configuration to try")
        key = (key, tuple(tuple(sorted(c.items())) for c in configs))
        first = self.chosen.get(key, 0)
        for i in range(first, len(configs)):
            try:
                result = run(configs[i])
            except OutOfResources:
                if i == len(configs) - 1:
                    raise
                continue
            self.chosen[key] = i
            return result


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
