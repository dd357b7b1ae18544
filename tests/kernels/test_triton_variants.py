"""Triton variants under TRITON_INTERPRET=1 (conftest.py) on small shapes, fp32 and fp16."""
import functools

import pytest
import torch

import kernels
from kernels import check, inputs, routing

DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,variant", [("paged_decode", "v2_triton"), ("prefix_prefill", "triton"),
                                        ("moe", "triton"), ("rms_norm", "triton"), ("qk_norm_rope", "triton"),
                                        ("gated_delta_rule", "triton_chunk"), ("gated_delta_rule", "triton_recurrent")])
def test_small_shape_list(op, variant, dtype):
    result = check.run(op, variant, "cpu", dtype, small=True)
    assert result["passed"], result


def _error(op, fn, args):
    return check.check_one(fn, kernels.get(op, "reference"), args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16)])
def test_prefill_tiles_below_and_on_the_diagonal(dtype, block_m, block_n):
    """Several tiles per sequence, so the unmasked loop, the diagonal and a ragged last tile all run."""
    args = inputs.prefix_prefill([(0, 50), (21, 37), (8, 1)], num_heads=4, num_kv_heads=2, head_size=16,
                                 block_size=8, dtype=dtype)
    fn = functools.partial(kernels.get("prefix_prefill", "triton"), block_m=block_m, block_n=block_n, num_warps=4)
    assert _error("prefix_prefill", fn, args) < check.TOLERANCE[dtype]


def test_prefill_rejects_block_m_not_a_multiple_of_block_n():
    args = inputs.prefix_prefill([(0, 4)], num_heads=2, num_kv_heads=1, head_size=16)
    with pytest.raises(ValueError, match="block_m"):
        kernels.get("prefix_prefill", "triton")(**args, block_m=48, block_n=32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_many_splits_and_explicit_bound(dtype):
    """A wide block table (padding past every sequence) and a tight ``max_seq_len`` give the same answer."""
    args = inputs.paged_decode([70, 3, 129], num_heads=4, num_kv_heads=2, head_size=16, block_size=8, dtype=dtype)
    fn = kernels.get("paged_decode", "v2_triton")
    wide = {**args, "block_tables": torch.nn.functional.pad(args["block_tables"], (0, 40), value=10**6)}
    assert _error("paged_decode", functools.partial(fn, block_n=16, min_split=16), wide) < check.TOLERANCE[dtype]
    assert _error("paged_decode", functools.partial(fn, max_seq_len=129, block_n=16, min_split=16),
                  args) < check.TOLERANCE[dtype]


@pytest.mark.parametrize("min_split", [16, 32, 48])
def test_decode_splits_follow_each_sequence_length(min_split):
    """The grid's split count is fixed on the host; each sequence spreads its own length over it,
    so a short and a long context in one launch both come out right (and a loose bound only adds
    programs that exit at once)."""
    args = inputs.paged_decode([1, 16, 17, 200, 95], num_heads=4, num_kv_heads=2, head_size=16, block_size=8)
    fn = kernels.get("paged_decode", "v2_triton")
    for bound in (200, 4096):
        err = _error("paged_decode", functools.partial(fn, max_seq_len=bound, block_n=16, min_split=min_split), args)
        assert err < check.TOLERANCE[torch.float32], (bound, err)


@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_whole_tiles_then_the_last_partial_one_in_block_pieces(block_size):
    """64-token tiles: contexts ending on a tile edge, one or several cache blocks past it, inside a
    block, and a single token; splits of 64 and 128 tokens so that several programs end mid-context."""
    args = inputs.paged_decode([64, 113, 50, 1, 200], num_heads=4, num_kv_heads=2, head_size=16,
                               block_size=block_size, seed=9)
    fn = kernels.get("paged_decode", "v2_triton")
    for min_split in (64, 128):
        err = _error("paged_decode", functools.partial(fn, block_n=64, min_split=min_split), args)
        assert err < check.TOLERANCE[torch.float32], (min_split, err)


def test_decode_merges_more_splits_than_one_reduction_chunk_holds():
    """63 splits of 16 tokens: the merge walks them 32 at a time."""
    args = inputs.paged_decode([1000, 37], num_heads=4, num_kv_heads=1, head_size=16, block_size=8, seed=4)
    fn = functools.partial(kernels.get("paged_decode", "v2_triton"), block_n=16, min_split=16, programs_per_sm=20)
    from kernels.decode_triton import num_splits
    assert num_splits(2, 1, args["block_tables"].shape[1] * 8, torch.device("cpu"), 16, 20) > 32
    assert _error("paged_decode", fn, args) < check.TOLERANCE[torch.float32]


def test_decode_split_count_fills_the_machine_and_respects_the_minimum_split():
    from kernels.decode_triton import num_splits
    cpu = torch.device("cpu")  # the interpreter counts 4 SMs: 32 programs wanted at 8 per SM
    assert num_splits(1, 2, 4096, cpu, 256) == 16
    assert num_splits(1, 2, 4096, cpu, 256, programs_per_sm=4) == 8
    assert num_splits(1, 2, 300, cpu, 256) == 2  # a 300-token bound fills 2 splits of 256
    assert num_splits(64, 2, 4096, cpu, 256) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16), dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32)])
def test_moe_block_configs_with_ragged_edges(dtype, config):
    """hidden and intermediate not multiples of the tiles; some experts get no token."""
    args = inputs.moe(19, hidden=48, experts=8, intermediate=40, top_k=3, dtype=dtype, unused_experts=2)
    fn = functools.partial(kernels.get("moe", "triton"), config={**config, "num_warps": 4, "num_stages": 1})
    assert _error("moe", fn, args) < check.TOLERANCE[dtype]


def test_align_block_size_groups_pairs_by_expert():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 3]])
    pairs, block_expert = routing.align_block_size(ids, num_experts=5, block_m=2)
    flat = ids.flatten()
    rows = pairs.view(-1, 2)
    for blk, e in enumerate(block_expert.tolist()):
        live = [p for p in rows[blk].tolist() if p < flat.numel()]
        if e < 0:
            assert not live
        else:
            assert live and all(flat[p] == e for p in live)
    assert sorted(p for p in pairs.tolist() if p < flat.numel()) == list(range(flat.numel()))
    assert block_expert.tolist()[:5] == [0, 1, 2, 2, 3]


@pytest.mark.parametrize("op", ["paged_decode", "prefix_prefill"])
def test_tiles_smaller_than_a_cache_block(op):
    """block_n 16 inside blocks of 32 slots: the other branch of ``paged_tile``."""
    shape = dict(num_heads=4, num_kv_heads=2, head_size=16, block_size=32, dtype=torch.float32)
    if op == "paged_decode":
        args = inputs.paged_decode([45, 70], **shape)
        fn = functools.partial(kernels.get(op, "v2_triton"), block_n=16)
    else:
        args = inputs.prefix_prefill([(45, 20), (33, 16)], **shape)
        fn = functools.partial(kernels.get(op, "triton"), block_m=16, block_n=16)
    assert _error(op, fn, args) < check.TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_norms_round_the_residual_sum_as_the_unfused_add_does(dtype):
    """The new residual is exactly x + residual in the input dtype, and both outputs match the torch path."""
    args = inputs.rms_norm(7, hidden=40, dtype=dtype, seed=5)
    out, res = kernels.get("rms_norm", "triton")(**args)
    t_out, t_res = kernels.get("rms_norm", "torch")(**args)
    assert torch.equal(res, args["x"] + args["residual"]) and torch.equal(t_res, res)
    assert check.rel_error(out, t_out) < check.TOLERANCE[dtype]


def test_qk_norm_rope_leaves_channels_past_the_rotary_dim_normalised_only():
    args = inputs.qk_norm_rope(4, num_heads=2, num_kv_heads=1, head_size=32, rotary_dim=8, seed=6)
    q, k = kernels.get("qk_norm_rope", "triton")(**args)
    plain = kernels.get("rms_norm", "torch")(args["q"].reshape(-1, 32), args["q_weight"], args["eps"]).view(4, 2, 32)
    torch.testing.assert_close(q[..., 8:], plain[..., 8:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(q[..., :8], plain[..., :8], atol=1e-3)
    assert q.is_contiguous() and k.shape == (4, 1, 32)


@pytest.mark.parametrize("tokens,experts,top_k,shared,block_m", [(1, 8, 2, 0, 16), (37, 12, 3, 1, 4), (70, 5, 1, 2, 8),
                                                                 (64, 16, 2, 0, 4), (200, 64, 8, 1, 16),
                                                                 (300, 20, 8, 1, 16)])
def test_triton_routing_and_alignment_match_the_torch_ones(tokens, experts, top_k, shared, block_m, monkeypatch):
    """Same experts, same weights, and the same rows as the stable sort, into buffers poisoned first: one
    program's pairs (2), exactly one (128), several (1,800), more than the scan takes in a step (2,700, 22
    programs, experts of ~200 pairs spanning programs); from the alignment's own counts and from those the
    routing kernel took."""
    from kernels import moe_triton
    from kernels.moe_triton import align_triton, route_triton
    empty = torch.empty
    monkeypatch.setattr(moe_triton.torch, "empty", lambda *a, **k: empty(*a, **k).fill_(-7))
    args = inputs.moe(tokens, hidden=16, experts=experts, intermediate=8, top_k=top_k, shared_experts=shared,
                      unused_experts=experts // 4, seed=tokens)
    for renormalize in (True, False):
        w, ids = route_triton(args["router_logits"], top_k, renormalize, shared)
        w0, ids0 = routing.route(args["router_logits"], top_k, renormalize, shared)
        assert torch.equal(ids.long(), ids0)
        torch.testing.assert_close(w, w0, rtol=1e-6, atol=1e-6)
    pairs, block_expert = align_triton(ids, experts + shared, block_m)
    pairs0, block_expert0 = routing.align_block_size(ids0, experts + shared, block_m)
    assert torch.equal(pairs, pairs0) and torch.equal(block_expert, block_expert0)
    # bounded to the blocks that can be in use: those rows and blocks alike, every live one inside
    from kernels.moe_triton import used_blocks
    n = used_blocks(ids.numel(), experts + shared, block_m)
    assert int((block_expert0 >= 0).sum()) <= n
    pairs_b, block_expert_b = align_triton(ids, experts + shared, block_m, n)
    n = min(n, block_expert0.numel())
    assert torch.equal(pairs_b[:n * block_m], pairs0[:n * block_m]) and torch.equal(block_expert_b[:n],
                                                                                      block_expert0[:n])
    # the MoE's way: the routing kernel counts its 16 tokens' pairs, and the alignment starts from those counts
    _, pairs_c, block_expert_c, blocks = moe_triton.route_and_align(args["router_logits"], top_k, True, shared,
                                                                     block_m)
    assert blocks == n
    assert torch.equal(pairs_c[:n * block_m], pairs0[:n * block_m]) and torch.equal(block_expert_c[:n],
                                                                                      block_expert0[:n])


def test_routing_reads_rows_of_a_padded_router_as_it_reads_contiguous_ones():
    """The engine's router is padded (engine.layers.moe): 9 logits a token in rows of 16. The routing and the
    alignment read the view's row stride, and give what they give on a contiguous copy."""
    from kernels import moe_triton
    padded = torch.randn(40, 16, generator=torch.Generator().manual_seed(3))
    view = padded[:, :9]
    for mine, theirs in zip(moe_triton.route_and_align(view, 3, True, 1, 4),
                            moe_triton.route_and_align(view.contiguous(), 3, True, 1, 4)):
        assert torch.equal(mine, theirs) if torch.is_tensor(mine) else mine == theirs
    w, ids = moe_triton.route_triton(view, 3, True, 1)
    w0, ids0 = routing.route(view.contiguous(), 3, True, 1)
    assert torch.equal(ids.long(), ids0)
    torch.testing.assert_close(w, w0, rtol=1e-6, atol=1e-6)


def test_a_decode_steps_alignment_takes_the_prefix_sums_in_its_scatter_launch(monkeypatch):
    """Up to SCAN_IN_SCATTER routing programs' histograms (256 tokens) the scatter programs sum them themselves, and
    no scan is launched; past that the scan runs first. The same rows either way as the stable sort."""
    from kernels import moe_triton
    scans = []

    class Counted:
        def __getitem__(self, grid):
            scans.append(grid)
            return original[grid]
    original = moe_triton._align_scan_kernel
    monkeypatch.setattr(moe_triton, "_align_scan_kernel", Counted())
    for tokens, scanned in ((moe_triton.SCAN_IN_SCATTER * moe_triton.ROUTE_TOKENS, 0),
                            (moe_triton.SCAN_IN_SCATTER * moe_triton.ROUTE_TOKENS + 1, 1)):
        args = inputs.moe(tokens, hidden=16, experts=32, intermediate=8, top_k=4, seed=tokens)
        scans.clear()
        _, pairs, block_expert, blocks = moe_triton.route_and_align(args["router_logits"], 4, True, 0, 16)
        _, ids0 = routing.route(args["router_logits"], 4, True, 0)
        pairs0, block_expert0 = routing.align_block_size(ids0, 32, 16)
        assert len(scans) == scanned, (tokens, scans)
        assert torch.equal(pairs[:blocks * 16], pairs0[:blocks * 16]) and torch.equal(block_expert[:blocks],
                                                                                    block_expert0[:blocks])


@pytest.mark.parametrize("variant", ["reference", "gather", "sorted", "triton"])
def test_a_shared_expert_is_the_gated_dense_mlp_added_to_the_routed_ones(variant):
    """shared_experts=1 equals the routed MoE plus sigmoid(gate logit) x the last expert's MLP."""
    import torch.nn.functional as F
    args = inputs.moe(11, hidden=32, experts=8, intermediate=16, top_k=2, shared_experts=1, seed=8)
    routed = kernels.get("moe", "reference")(args["hidden_states"].double(), args["router_logits"][:, :8].double(),
                                             args["w13"][:8].double(), args["w2"][:8].double(), 2)
    x = args["hidden_states"].double()
    gate, up = (x @ args["w13"][8].double().T).chunk(2, dim=-1)
    shared = (F.silu(gate) * up) @ args["w2"][8].double().T
    expected = routed + torch.sigmoid(args["router_logits"][:, 8:].double()) * shared
    out = kernels.get("moe", variant)(**args)
    assert check.rel_error(out, expected) < 1e-5
