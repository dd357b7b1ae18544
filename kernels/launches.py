"""The kernels a piece of code launches, counted with or without a GPU.

On CUDA the profiler lists them. Elsewhere ``Launches`` (a dispatch mode) lists what would launch on
a GPU: every aten op but views and allocations, and every Triton kernel by name (the ops Triton's
interpreter runs to copy a kernel's arguments are not the code's own); it also counts reads back to
the host (``.item()``, ``.tolist()``), which a CUDA graph cannot capture. So a CPU test can hold a
decode step to a number of launches.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that allocate or re-describe memory without a kernel (views are recognised by their schema)
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
             "lift_fresh", "_unsafe_view", "_reshape_alias", "set_", "resize_"}


def _returns_tensors(func) -> bool:
    """Whether an op's results hold a tensor (``promote_types``, ``sym_size`` and the like run on the host)."""
    return any("Tensor" in str(r.type) for r in func._schema.returns)


class Launches(TorchDispatchMode):
    """Within it: ``kernels`` (names, in launch order) and ``syncs``."""

    active: "Launches | None" = None

    def __init__(self):
        super().__init__()
        self.kernels: list[str] = []
        self.syncs = 0
        self._inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside_triton:
            name = func.overloadpacket.__name__
            if func is torch.ops.aten._local_scalar_dense.default:
                self.syncs += 1
            elif not func.is_view and name not in NO_KERNEL and _returns_tensors(func):
                self.kernels.append(name)
        return func(*args, **(kwargs or {}))

    def triton(self, name: str, launch: Callable):
        self.kernels.append(f"triton:{name}")
        self._inside_triton += 1
        try:
            return launch()
        finally:
            self._inside_triton -= 1

    def __enter__(self):
        Launches.active = self
        self._patches = contextlib.ExitStack()
        self._patches.enter_context(_triton_hook())
        return super().__enter__()

    def __exit__(self, *exc):
        Launches.active = None
        self._patches.close()
        return super().__exit__(*exc)


@contextlib.contextmanager
def _triton_hook():
    """Route Triton launches (interpreted or compiled) through the active ``Launches``; only where
    Triton is loaded already, so that counting torch code never imports it."""
    if "triton" not in sys.modules:
        yield
        return
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    grid_call, jit_run = interpreter.GridExecutor.__call__, JITFunction.run

    def interpreted(self, *args, **kwargs):
        counter = Launches.active
        if counter is None:
            return grid_call(self, *args, **kwargs)
        return counter.triton(self.fn.__name__, lambda: grid_call(self, *args, **kwargs))

    def compiled(self, *args, **kwargs):
        counter = Launches.active
        if counter is None or kwargs.get("warmup"):
            return jit_run(self, *args, **kwargs)
        return counter.triton(self.fn.__name__, lambda: jit_run(self, *args, **kwargs))

    interpreter.GridExecutor.__call__, JITFunction.run = interpreted, compiled
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__, JITFunction.run = grid_call, jit_run


def cuda_kernels(fn: Callable[[], object]) -> list[str]:
    """Names of the CUDA kernels ``fn`` launches (torch.profiler; copies and fills by the driver left out)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))]


def kernels_launched(fn: Callable[[], object], device: torch.device) -> list[str]:
    """Names of the kernels ``fn`` launches on ``device``: the profiler's on CUDA, ``Launches`` elsewhere."""
    if device.type == "cuda":
        return cuda_kernels(fn)
    with Launches() as launches:
        fn()
    return launches.kernels
