"""The sparse MoE feed-forward: a router, top-k experts through the chosen ``moe`` kernel, and a
shared expert scaled by its own sigmoid gate (Qwen2-MoE / Qwen3-Next style)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernel_choice import Kernels


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, shared_intermediate: int,
                 renormalize: bool, kernels: Kernels):
        super().__init__()
        self.top_k, self.renormalize, self.kernels = top_k, renormalize, kernels
        self.router = nn.Parameter(torch.empty(num_experts, hidden))
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))  # gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.shared_intermediate = shared_intermediate
        if shared_intermediate:
            self.shared_gate_up = nn.Parameter(torch.empty(2 * shared_intermediate, hidden))
            self.shared_down = nn.Parameter(torch.empty(hidden, shared_intermediate))
            self.shared_expert_gate = nn.Parameter(torch.empty(1, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router)
        out = self.kernels.moe(x, logits, self.w13, self.w2, self.top_k, renormalize=self.renormalize)
        if self.shared_intermediate:
            gate, up = F.linear(x, self.shared_gate_up).chunk(2, dim=-1)
            shared = F.linear(F.silu(gate) * up, self.shared_down)
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
        return out
