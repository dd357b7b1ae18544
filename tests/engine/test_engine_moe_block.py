"""The MoE block's router: rows padded with zeros so that each token's logits start 16-byte aligned (Triton's
routing kernel vectorises its loads, and keeps its top-k reductions within warps, only then), with the same
logits and output as the unpadded router, to rounding."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import kernels
from engine.layers.moe import ROUTER_ROWS, SparseMoeBlock


def block(intermediate: int, shared: int, moe) -> SparseMoeBlock:
    torch.manual_seed(0)
    b = SparseMoeBlock(hidden=32, num_experts=8, top_k=2, intermediate=intermediate, shared_intermediate=shared,
                       renormalize=True, kernels=types.SimpleNamespace(moe=moe)).requires_grad_(False)
    with torch.no_grad():
        for _, t in b.init_views():
            t.normal_(0.0, t.shape[-1] ** -0.5)
    return b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_gets_aligned_rows_of_the_real_logits_and_the_padding_is_zero(dtype):
    seen = {}

    def moe(x, logits, w13, w2, top_k, **kw):
        seen.update(logits=logits, kw=kw)
        return kernels.get("moe", "sorted")(x, logits, w13, w2, top_k, **kw)

    b = block(16, 16, moe).to(dtype)  # the shared expert folded in: 9 router rows
    x = torch.randn(5, 32, dtype=dtype)
    out = b(x)
    logits = seen["logits"]
    assert logits.shape == (5, 9) and seen["kw"]["shared_experts"] == 1
    assert (logits.stride(0) * logits.element_size()) % 16 == 0 and logits.stride(1) == 1
    assert b.gate.shape[0] % ROUTER_ROWS == 0 and torch.all(b.gate[9:] == 0)
    # the padding changes no logit beyond rounding (a GEMM of another width may sum in another order)
    torch.testing.assert_close(logits, F.linear(x, b.gate[:9].contiguous()))
    assert torch.equal(b.shared_expert_gate, b.gate[8:9])
    unpadded = kernels.get("moe", "sorted")(x, F.linear(x, b.gate[:9].contiguous()), b.experts_w13, b.experts_w2, 2,
                                           renormalize=True, shared_experts=1)
    torch.testing.assert_close(out, unpadded)


def test_an_unfolded_shared_expert_keeps_its_own_gate_and_the_router_its_experts():
    b = block(16, 8, lambda x, logits, *a, **kw: torch.zeros_like(x) + logits.shape[1])
    assert b.router.shape == (8, 32) and b.shared_expert_gate.shape == (1, 32)
    out = b(torch.randn(3, 32))
    assert out.shape == (3, 32)  # the kernel saw the 8 experts' logits only, not the padding
