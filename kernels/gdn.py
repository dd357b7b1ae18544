"""The ``gated_delta_rule`` op's contract, shared by every variant: argument checks, the packed
(varlen) view of the inputs, and where each sequence's state comes from and goes to.

    o, final_state = gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                      output_final_state=False, use_qk_l2norm_in_kernel=False,
                                      cu_seqlens=None, state_slots=None)

q, k ``[B, T, Hk, K]``; v ``[B, T, H, V]`` with H a multiple of Hk (value head h reads query/key head
``h // (H // Hk)``); g (log of the per-step decay) and beta ``[B, T, H]``. Per sequence and head,
with ``S`` a ``[K, V]`` state starting at ``initial_state`` (zero when None):

    S = exp(g_t) * S;  S = S + k_t (beta_t * (v_t - S^T k_t))^T;  o_t = scale * S^T q_t

``use_qk_l2norm_in_kernel`` first divides q and k by their L2 norm (``x * rsqrt(sum(x^2) + 1e-6)``,
as flash-linear-attention and Qwen3-Next do); without it q and k are used as given. ``cu_seqlens``
(B = 1) packs N sequences along T. ``initial_state`` is ``[N, H, K, V]``; with ``state_slots``
(int ``[N]``, distinct) it is instead a pool of states: sequence n starts from
``initial_state[state_slots[n]]`` and its final state is written back there in place (the second
result is then None). Otherwise the final state is returned when ``output_final_state``, in
``initial_state``'s dtype, or float32 (float64 for float64 inputs) without one.
"""
from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def check(q, k, v, g, beta, initial_state=None, cu_seqlens=None, state_slots=None) -> int:
    """Validate the operands (``ValueError`` naming the argument); returns the number of sequences."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, heads, K], got {tuple(q.shape)}")
    b, t, hk, dk = q.shape
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k {tuple(k.shape)} must have q's shape {tuple(q.shape)}")
    if v.dim() != 4 or tuple(v.shape[:2]) != (b, t) or v.shape[2] % hk:
        raise ValueError(f"v must be [{b}, {t}, H, V] with H a multiple of {hk}, got {tuple(v.shape)}")
    h, dv = v.shape[2], v.shape[3]
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (b, t, h):
            raise ValueError(f"{name} must be [{b}, {t}, {h}], got {tuple(x.shape)}")
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"cu_seqlens needs q with B = 1 (sequences packed along T), got B = {b}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be an integer tensor [N + 1], got {tuple(cu_seqlens.shape)}")
        n = cu_seqlens.numel() - 1
    else:
        n = b
    if state_slots is not None:
        if initial_state is None:
            raise ValueError("state_slots needs initial_state: the pool the slots index")
        if tuple(state_slots.shape) != (n,) or state_slots.is_floating_point():
            raise ValueError(f"state_slots must be an integer tensor [{n}], got {tuple(state_slots.shape)}")
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (h, dk, dv):
            raise ValueError(f"initial_state (the pool) must be [slots, {h}, {dk}, {dv}], "
                             f"got {tuple(initial_state.shape)}")
    elif initial_state is not None and tuple(initial_state.shape) != (n, h, dk, dv):
        raise ValueError(f"initial_state must be [{n}, {h}, {dk}, {dv}], got {tuple(initial_state.shape)}")
    return n


def state_dtype(q: torch.Tensor, initial_state: torch.Tensor | None) -> torch.dtype:
    if initial_state is not None:
        return initial_state.dtype
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def packed(q, k, v, g, beta):
    """(q, k, v, g, beta) as [total_tokens, heads, ...]: B equal-length sequences become B packed ones."""
    b, t = q.shape[:2]
    return (q.reshape(b * t, *q.shape[2:]), k.reshape(b * t, *k.shape[2:]), v.reshape(b * t, *v.shape[2:]),
            g.reshape(b * t, -1), beta.reshape(b * t, -1))


def bounds(b: int, t: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """The packed sequences' boundaries [N + 1], int64 on ``device``: ``cu_seqlens``, or B of T tokens."""
    if cu_seqlens is None:
        return torch.arange(b + 1, device=device, dtype=torch.int64) * t
    return cu_seqlens.to(torch.int64)


def spans(b: int, t: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """Each sequence's [start, end) token range once packed, on the host: from the shape for B
    sequences of T tokens, else read from ``cu_seqlens`` (one device sync)."""
    if cu_seqlens is None:
        return [(i * t, (i + 1) * t) for i in range(b)]
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def state_buffer(q, v, initial_state, state_slots, n: int):
    """(buffer, slots, returned): the states each sequence reads from and writes to in place
    (``buffer[slots[i]]``), and whether the buffer is the second result. ``buffer`` is the pool in
    slot mode, else a fresh copy of ``initial_state`` (zeros without one)."""
    if state_slots is not None:
        return initial_state, state_slots.to(torch.int64), False
    h, dk, dv = v.shape[2], q.shape[3], v.shape[3]
    if initial_state is None:
        buf = torch.zeros(n, h, dk, dv, dtype=state_dtype(q, None), device=q.device)
    else:
        buf = initial_state.clone()
    return buf, torch.arange(n, device=q.device), True
