"""The sparse MoE feed-forward: a router, top-k experts through the chosen ``moe`` kernel, and a
shared expert scaled by its own sigmoid gate (Qwen2-MoE / Qwen3-Next style).

When the shared expert has the routed experts' shape (Qwen3.6: 512 and 512) it is folded into
them: its weights are one more expert after the routed ones and its gate one more router row, so
the ``moe`` kernel runs it in the same grouped GEMMs (``shared_experts=1``) and the whole block is
one router projection plus the kernel. ``router``, ``w13``, ``w2`` and the ``shared_*`` names stay
readable as views either way.

The router's rows are padded with zeros to a multiple of ``ROUTER_ROWS``, so that each token's row of logits
starts 16-byte aligned (257 bf16 logits a row would not be): Triton lays the routing kernel's tile out for vector
loads only then, and with scalar loads its top-k reductions cross warps (on sm_90, 1,072 shuffles and 74 barriers
a program against 184 and 10).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernel_choice import Kernels

ROUTER_ROWS = 16


def router_width(rows: int) -> int:
    """The router's rows padded with zero rows to a multiple of ROUTER_ROWS."""
    return -(-rows // ROUTER_ROWS) * ROUTER_ROWS


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, shared_intermediate: int,
                 renormalize: bool, kernels: Kernels):
        super().__init__()
        self.top_k, self.renormalize, self.kernels = top_k, renormalize, kernels
        self.num_experts, self.shared_intermediate = num_experts, shared_intermediate
        self.folded = shared_intermediate == intermediate > 0
        self.gate_rows = n = num_experts + (1 if self.folded else 0)
        # router rows, then the shared expert's gate, then zero rows up to a multiple of ROUTER_ROWS
        self.gate = nn.Parameter(torch.zeros(router_width(n), hidden))
        self.experts_w13 = nn.Parameter(torch.empty(n, 2 * intermediate, hidden))  # gate rows, then up rows
        self.experts_w2 = nn.Parameter(torch.empty(n, hidden, intermediate))
        if shared_intermediate and not self.folded:
            self.shared_gate_up_proj = nn.Parameter(torch.empty(2 * shared_intermediate, hidden))
            self.shared_down_proj = nn.Parameter(torch.empty(hidden, shared_intermediate))
            self.shared_gate_proj = nn.Parameter(torch.empty(1, hidden))

    # views with the unfolded shapes
    @property
    def router(self) -> torch.Tensor:
        return self.gate[:self.num_experts]

    @property
    def w13(self) -> torch.Tensor:
        return self.experts_w13[:self.num_experts]

    @property
    def w2(self) -> torch.Tensor:
        return self.experts_w2[:self.num_experts]

    @property
    def shared_gate_up(self) -> torch.Tensor:
        return self.experts_w13[-1] if self.folded else self.shared_gate_up_proj

    @property
    def shared_down(self) -> torch.Tensor:
        return self.experts_w2[-1] if self.folded else self.shared_down_proj

    @property
    def shared_expert_gate(self) -> torch.Tensor:
        return self.gate[self.gate_rows - 1:self.gate_rows] if self.folded else self.shared_gate_proj

    def init_views(self) -> list[tuple[str, torch.Tensor]]:
        """The weights in the order and shapes of the unfolded layout, so that random weights drawn
        from one seed are the same whether the shared expert is folded in or not."""
        views = [("router", self.router), ("w13", self.w13), ("w2", self.w2)]
        if self.shared_intermediate:
            views += [("shared_gate_up", self.shared_gate_up), ("shared_down", self.shared_down),
                      ("shared_expert_gate", self.shared_expert_gate)]
        return views

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate)[:, :self.gate_rows]
        if self.folded:
            return self.kernels.moe(x, logits, self.experts_w13, self.experts_w2, self.top_k,
                                    renormalize=self.renormalize, shared_experts=1)
        out = self.kernels.moe(x, logits, self.experts_w13, self.experts_w2, self.top_k, renormalize=self.renormalize)
        if self.shared_intermediate:
            gate, up = F.linear(x, self.shared_gate_up).chunk(2, dim=-1)
            shared = F.linear(F.silu(gate) * up, self.shared_down)
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
        return out
