"""Per-step metadata of eager steps (token ids, positions, slots, block tables, lengths) staged in
persistent pinned host buffers and copied to the GPU without blocking the host.

A step's values are appended to one pinned buffer per dtype and each tensor is a non-blocking
copy of its slice. Before the next step overwrites the buffers, it waits on an event recorded
after the last step's copies (they are long done by then: they precede that step's kernels).
On the CPU the same buffers are used, unpinned, and each tensor is a copy of its slice.
"""
from __future__ import annotations

import torch


class HostStaging:
    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = device
        self.pinned = device.type == "cuda"
        self._capacity = capacity
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._used: dict[torch.dtype, int] = {}
        self._retired: list[torch.Tensor] = []  # outgrown buffers a pending copy may still read
        self._copied: torch.cuda.Event | None = None

    def begin_step(self) -> None:
        """Start a step: the previous step's copies have finished reading the buffers."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        self._used = dict.fromkeys(self._buffers, 0)
        self._retired = []

    def tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        n, start = len(values), self._used.get(dtype, 0)
        buf = self._buffers.get(dtype)
        if buf is None or start + n > buf.numel():
            if buf is not None:
                self._retired.append(buf)
            buf = torch.empty(max(self._capacity, 2 * n), dtype=dtype, pin_memory=self.pinned)
            self._buffers[dtype], start = buf, 0
        view = buf[start:start + n]
        view.numpy()[:] = values
        self._used[dtype] = start + n
        if not self.pinned:
            return view.clone()
        out = view.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out
