"""Random, valid inputs for each op, shared by the checks, the benches and the tests.

Block tables list blocks in a shuffled order and pad with an out-of-range block id, so a kernel that
reads a padding entry or assumes contiguous blocks faults or fails its check. Cache slots that hold
no token (unused blocks, the tail of each sequence's last block) are NaN, as uninitialised memory
may be: a kernel that lets them into its result fails.
"""
from __future__ import annotations

import math

import torch


def _cache(num_blocks, kv_heads, head_size, block_size, dtype, device, gen):
    x = 16 // torch.empty((), dtype=dtype).element_size()
    k = torch.randn(num_blocks, kv_heads, head_size // x, block_size, x, generator=gen, device=device).to(dtype)
    v = torch.randn(num_blocks, kv_heads, head_size, block_size, generator=gen, device=device).to(dtype)
    return k, v


def _blank_unused(k, v, tables, lens, block_size):
    """NaN into every cache slot that no sequence's first ``lens[i]`` tokens occupy."""
    used = torch.zeros(k.shape[0], block_size, dtype=torch.bool)
    for row, n in zip(tables.tolist(), lens):
        for t in range(0, n, block_size):
            used[row[t // block_size], : min(block_size, n - t)] = True
    used = used.to(k.device)
    k.masked_fill_(~used[:, None, None, :, None], float("nan"))
    v.masked_fill_(~used[:, None, None, :], float("nan"))


def _tables(lens, block_size, device, gen, spare=2):
    """(block_tables int32, num_blocks): each sequence's blocks, shuffled across the pool."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=gen, device=gen.device).cpu()
    width = max(max(need, default=0), 1) + 1
    tables = torch.full((len(lens), width), num_blocks + 1000, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[at:at + n].int()
        at += n
    return tables.to(device), num_blocks


def _generator(device, seed):
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed() % (2**63))
    return gen


def paged_decode(seq_lens, num_heads=16, num_kv_heads=2, head_size=256, block_size=16, dtype=torch.float32,
                 device="cpu", seed=None) -> dict:
    gen = _generator(device, seed)
    tables, num_blocks = _tables(seq_lens, block_size, device, gen)
    k, v = _cache(num_blocks, num_kv_heads, head_size, block_size, dtype, device, gen)
    _blank_unused(k, v, tables, seq_lens, block_size)
    q = torch.randn(len(seq_lens), num_heads, head_size, generator=gen, device=device).to(dtype)
    return dict(query=q, key_cache=k, value_cache=v, block_tables=tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), scale=1 / math.sqrt(head_size))


def prefix_prefill(seqs, num_heads=16, num_kv_heads=2, head_size=256, block_size=16, dtype=torch.float32,
                   device="cpu", seed=None) -> dict:
    """``seqs``: (context_len, new_len) per sequence."""
    gen = _generator(device, seed)
    ctx = [c for c, _ in seqs]
    tables, num_blocks = _tables(ctx, block_size, device, gen)
    k, v = _cache(num_blocks, num_kv_heads, head_size, block_size, dtype, device, gen)
    _blank_unused(k, v, tables, ctx, block_size)
    total = sum(n for _, n in seqs)
    starts = [0]
    for _, n in seqs:
        starts.append(starts[-1] + n)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    return dict(query=rand(total, num_heads, head_size), key=rand(total, num_kv_heads, head_size),
                value=rand(total, num_kv_heads, head_size), key_cache=k, value_cache=v, block_tables=tables,
                query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                context_lens=torch.tensor(ctx, dtype=torch.int32, device=device), scale=1 / math.sqrt(head_size))


def moe(tokens, hidden=2048, experts=256, intermediate=512, top_k=8, dtype=torch.float32, device="cpu", seed=None,
        unused_experts=0, shared_experts=0) -> dict:
    """``unused_experts``: that many experts get logits so low that no token picks them.
    ``shared_experts``: that many more experts (weights and logit columns) every token uses."""
    gen = _generator(device, seed)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    logits = torch.randn(tokens, experts + shared_experts, generator=gen, device=device)
    if unused_experts:
        logits[:, torch.randperm(experts, generator=gen, device=device)[:unused_experts]] -= 1e4
    total = experts + shared_experts
    args = dict(hidden_states=rand(tokens, hidden), router_logits=logits.to(dtype),
                w13=rand(total, 2 * intermediate, hidden, std=hidden ** -0.5),
                w2=rand(total, hidden, intermediate, std=intermediate ** -0.5), top_k=top_k)
    if shared_experts:
        args["shared_experts"] = shared_experts
    return args


def rms_norm(tokens, hidden=2048, residual=True, dtype=torch.float32, device="cpu", seed=None) -> dict:
    gen = _generator(device, seed)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    args = dict(x=rand(tokens, hidden), weight=(1 + rand(hidden, std=0.1)).to(dtype), eps=1e-6)
    if residual:
        args["residual"] = rand(tokens, hidden, std=4.0)
    return args


def qk_norm_rope(tokens, num_heads=16, num_kv_heads=2, head_size=256, rotary_dim=64, gated=True, theta=1e7,
                 dtype=torch.float32, device="cpu", seed=None) -> dict:
    """q and k as the engine holds them: strided views into one fused qkv projection output (with a
    sigmoid gate after each query head when ``gated``)."""
    gen = _generator(device, seed)
    q_width = num_heads * head_size * (2 if gated else 1)
    qkv = (torch.randn(tokens, q_width + 2 * num_kv_heads * head_size, generator=gen, device=device) * 3).to(dtype)
    q = qkv[:, :q_width].view(tokens, num_heads, -1)[:, :, :head_size]
    k = qkv[:, q_width:q_width + num_kv_heads * head_size].view(tokens, num_kv_heads, head_size)
    positions = torch.randint(0, 100_000, (tokens,), generator=gen, device=device)
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    freqs = positions.float()[:, None] * inv[None, :]

    def weight():
        return (1 + 0.1 * torch.randn(head_size, generator=gen, device=device)).to(dtype)

    return dict(q=q, k=k, q_weight=weight(), k_weight=weight(), cos=freqs.cos(), sin=freqs.sin(), eps=1e-6)


def gated_delta_rule(seq_lens, num_heads=4, num_k_heads=None, head_k=32, head_v=32, packed=None, l2norm=True,
                     initial_state=True, slots=False, narrow_state=False, dtype=torch.float32, device="cpu",
                     seed=None) -> dict:
    """Sequences of ``seq_lens`` tokens, packed along T (``cu_seqlens``) unless all have one length
    (then [B, T]; ``packed`` forces either). Decays range from fast to nearly none across heads, so a
    head remembers its state for a few to a few hundred tokens. ``l2norm``: normalised in the kernel
    (else q and k come normalised: the rule needs unit keys to stay stable). ``slots``: the states
    live in a larger pool, in shuffled rows, and are updated in place there. The states are float32, or with
    ``narrow_state`` in the inputs' dtype (an engine's ``mamba-ssm-cache-dtype: bfloat16``)."""
    gen = _generator(device, seed)
    hk = num_k_heads or num_heads
    packed = len(set(seq_lens)) > 1 if packed is None else packed
    b, t = (1, sum(seq_lens)) if packed else (len(seq_lens), seq_lens[0])
    n = len(seq_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q, k = rand(b, t, hk, head_k), rand(b, t, hk, head_k)
    if not l2norm:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    head_bias = torch.linspace(1.0, 6.0, num_heads, device=device)
    g = torch.nn.functional.logsigmoid(1.5 * rand(b, t, num_heads) + head_bias)
    args = dict(q=q.to(dtype), k=k.to(dtype), v=rand(b, t, num_heads, head_v).to(dtype), g=g.to(dtype),
                beta=torch.sigmoid(rand(b, t, num_heads)).to(dtype), initial_state=None, output_final_state=True,
                use_qk_l2norm_in_kernel=l2norm, cu_seqlens=None, state_slots=None)
    if packed:
        starts = [0]
        for length in seq_lens:
            starts.append(starts[-1] + length)
        args["cu_seqlens"] = torch.tensor(starts, dtype=torch.int32, device=device)
    if slots:
        args["initial_state"] = rand(n + 3, num_heads, head_k, head_v)
        args["state_slots"] = torch.randperm(n + 3, generator=gen, device=device)[:n].int()
        args["output_final_state"] = False
    elif initial_state:
        args["initial_state"] = rand(n, num_heads, head_k, head_v)
    if narrow_state and args["initial_state"] is not None:
        args["initial_state"] = args["initial_state"].to(dtype)
    return args


def causal_conv1d(seq_lens, channels=64, width=4, packed=None, dtype=torch.float32, device="cpu", seed=None) -> dict:
    """Sequences of ``seq_lens`` tokens, packed along T (``cu_seqlens``) unless all have one length
    (then [B, T]; ``packed`` forces either), as the engine holds them: x a view into a wider
    projection output, every state in a pool of shuffled slots, updated in place there."""
    gen = _generator(device, seed)
    packed = len(set(seq_lens)) > 1 if packed is None else packed
    b, t = (1, sum(seq_lens)) if packed else (len(seq_lens), seq_lens[0])
    n = len(seq_lens)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    wide = rand(b, t, channels + 24)  # the projection's other outputs (z) after the channels
    args = dict(x=wide[..., :channels], weight=rand(channels, width, std=width ** -0.5),
                conv_state=rand(n + 3, channels, width - 1),
                state_slots=torch.randperm(n + 3, generator=gen, device=device)[:n], cu_seqlens=None)
    if packed:
        starts = [0]
        for length in seq_lens:
            starts.append(starts[-1] + length)
        args["cu_seqlens"] = torch.tensor(starts, dtype=torch.int32, device=device)
    return args


def gdn_gating(tokens, num_heads=32, dtype=torch.float32, device="cpu", seed=None) -> dict:
    """a and b as views into one projection output; A = exp(A_log) in [0.05, 1] and dt_bias around
    0 as the engine draws them; a spread so that softplus meets both its tails (past its linear
    threshold of 20, and far below 0)."""
    gen = _generator(device, seed)
    b, a = torch.randn(2, tokens, num_heads, generator=gen, device=device) * 4
    a.view(-1)[::7] *= 6  # some a + dt_bias beyond +-20
    ba = torch.cat([b, a], dim=1).to(dtype)
    a_log = torch.empty(num_heads, device=device).uniform_(0.05, 1.0, generator=gen).log()
    return dict(a=ba[:, num_heads:], b=ba[:, :num_heads], A_log=a_log.to(dtype),
                dt_bias=(torch.randn(num_heads, generator=gen, device=device) * 0.5).to(dtype))


def rms_norm_gated(tokens, num_heads=32, head_size=128, dtype=torch.float32, device="cpu", seed=None) -> dict:
    """x as the recurrence returns it; the gate z a strided view into the projection that gives q, k, v, z."""
    gen = _generator(device, seed)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    width = num_heads * head_size
    qkvz = rand(tokens, 40 + width, std=2.0)
    return dict(x=rand(tokens, num_heads, head_size, std=0.3), gate=qkvz[:, 40:].view(tokens, num_heads, head_size),
                weight=(1 + rand(head_size, std=0.1)).to(dtype), eps=1e-6)
