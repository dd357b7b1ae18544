"""The gated delta rule: the float64 reference against an independent formulation, every variant's
slot, packing and continuation semantics, and the check failing the bugs it is there to catch."""
import functools

import numpy as np
import pytest
import torch

import kernels
from kernels import check, inputs

OP = "gated_delta_rule"
VARIANTS = kernels.variants(OP)[1:]
TRITON = [v for v in VARIANTS if kernels.uses_triton(OP, v)]


def _naive(q, k, v, g, beta, s0, scale, l2norm):
    """One sequence, one head at a time, in numpy: S <- exp(g) (I - beta k k^T) S + beta k v^T, o = scale S^T q."""
    q, k, v, g, beta, s0 = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta, s0))
    t, hk, dk = q.shape
    h = v.shape[1]
    out, states = np.zeros(v.shape), np.zeros(s0.shape)
    for head in range(h):
        s = s0[head].copy()
        for i in range(t):
            qi, ki = q[i, head * hk // h], k[i, head * hk // h]
            if l2norm:
                qi, ki = qi / np.sqrt(qi @ qi + 1e-6), ki / np.sqrt(ki @ ki + 1e-6)
            b = beta[i, head]
            s = np.exp(g[i, head]) * (np.eye(dk) - b * np.outer(ki, ki)) @ s + b * np.outer(ki, v[i, head])
            out[i, head] = scale * s.T @ qi
        states[head] = s
    return out, states


@pytest.mark.parametrize("l2norm", [True, False])
def test_reference_matches_the_transition_matrix_form(l2norm):
    lens = [5, 1, 12]
    args = check.as_float64(inputs.gated_delta_rule(lens, num_heads=4, num_k_heads=2, head_k=8, head_v=4,
                                                    l2norm=l2norm, seed=7))
    o, final = kernels.get(OP, "reference")(**{**args, "scale": 0.3})
    cu = args["cu_seqlens"].tolist()
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        x = {name: args[name][0, a:b].numpy() for name in ("q", "k", "v", "g", "beta")}
        want_o, want_s = _naive(**x, s0=args["initial_state"][n].numpy(), scale=0.3, l2norm=l2norm)
        np.testing.assert_allclose(o[0, a:b].numpy(), want_o, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(final[n].numpy(), want_s, rtol=1e-10, atol=1e-12)


def test_reference_defaults_scale_and_zero_state():
    args = check.as_float64(inputs.gated_delta_rule([6, 6], num_heads=2, head_k=16, head_v=8, seed=3,
                                                    initial_state=False))
    o, final = kernels.get(OP, "reference")(**args)
    for b in range(2):
        x = {name: args[name][b].numpy() for name in ("q", "k", "v", "g", "beta")}
        want_o, want_s = _naive(**x, s0=np.zeros((2, 16, 8)), scale=16 ** -0.5, l2norm=True)
        np.testing.assert_allclose(o[b].numpy(), want_o, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(final[b].numpy(), want_s, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_state_dtype_and_none_without_output_final_state(variant):
    args = inputs.gated_delta_rule([3, 3], num_heads=2, head_k=16, head_v=16, initial_state=False, seed=1)
    o, final = kernels.get(OP, variant)(**args)
    assert o.dtype == torch.float32 and final.dtype == torch.float32 and final.shape == (2, 2, 16, 16)
    assert kernels.get(OP, variant)(**{**args, "output_final_state": False})[1] is None
    half = {k: (v.half() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in args.items()}
    o, final = kernels.get(OP, variant)(**half)
    assert o.dtype == torch.float16 and final.dtype == torch.float32


@pytest.mark.parametrize("variant,dtype", [(v, d) for v in VARIANTS for d in (torch.float16, torch.bfloat16)
                                           if d == torch.float16 or v not in TRITON])
def test_a_16_bit_state_pool_is_updated_in_place_in_its_dtype(variant, dtype):
    """An engine with ``mamba-ssm-cache-dtype: bfloat16`` keeps its state pool in 16 bits: a prefill and a
    decode step read their slots from it and write them back in it, within the dtype's tolerance of float64,
    the other slots untouched (``check_slots``). Triton's interpreter runs fp16, not bf16."""
    fn, ref = kernels.get(OP, variant), kernels.get(OP, "reference")
    for lens in ([9, 1, 20], [1, 1, 1]):
        args = inputs.gated_delta_rule(lens, num_heads=4, num_k_heads=2, head_k=16, head_v=16, slots=True,
                                       narrow_state=True, dtype=dtype, seed=len(lens) + sum(lens))
        pool, before = args["initial_state"], args["initial_state"].clone()
        assert pool.dtype == dtype
        assert check.check_slots(fn, ref, args, OP) <= check.TOLERANCE[dtype]
        assert args["initial_state"] is pool and pool.dtype == dtype
        assert not torch.equal(pool[args["state_slots"].long()], before[args["state_slots"].long()])


@pytest.mark.parametrize("prefill,decode", [("chunk", "recurrent"), ("recurrent", "chunk"),
                                            ("triton_chunk", "triton_recurrent")])
def test_prefill_then_decode_in_slots_equals_one_long_prefill(prefill, decode):
    """The engine's pattern: packed prefill chunks of several sequences, then decode steps, with
    every state in a shared pool; equal to one reference call over all the tokens."""
    lens, steps = [19, 1, 33], 3
    full = inputs.gated_delta_rule([n + steps for n in lens], num_heads=4, num_k_heads=2, head_k=16, head_v=16,
                                   packed=True, seed=11)
    ref_o, ref_s = kernels.get(OP, "reference")(**check.as_float64(full))
    cu = full["cu_seqlens"].tolist()
    pool = torch.full((6, 4, 16, 16), float("nan"))
    slots = torch.tensor([5, 0, 3])
    pool[slots] = full["initial_state"]
    seq = ("q", "k", "v", "g", "beta")
    # prefill: every sequence's tokens in two chunks (the second continues from the pool; the
    # one-token sequence has none left for it: an empty sequence in the pack)
    for lo, hi in ((0, 10), (10, None)):
        parts = [(a + min(lo, n), a + (n if hi is None else min(hi, n))) for a, n in zip(cu[:-1], lens)]
        idx = torch.cat([torch.arange(a, b) for a, b in parts])
        starts = torch.tensor([0] + list(np.cumsum([b - a for a, b in parts])), dtype=torch.int32)
        o, none = kernels.get(OP, prefill)(**{**full, **{k: full[k][:, idx] for k in seq}, "cu_seqlens": starts,
                                               "initial_state": pool, "state_slots": slots})
        assert none is None
        torch.testing.assert_close(o[0].double(), ref_o[0, idx], rtol=1e-4, atol=1e-5)
    for t in range(steps):  # decode: one token per sequence, [B, 1]
        idx = torch.tensor([a + n + t for a, n in zip(cu[:-1], lens)])
        o, _ = kernels.get(OP, decode)(**{**full, **{k: full[k][0, idx][:, None] for k in seq}, "cu_seqlens": None,
                                           "initial_state": pool, "state_slots": slots})
        torch.testing.assert_close(o[:, 0].double(), ref_o[0, idx], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[slots].double(), ref_s, rtol=1e-4, atol=1e-5)
    assert torch.isnan(pool[[1, 2, 4]]).all()  # slots no sequence uses are untouched


@pytest.mark.parametrize("variant", TRITON)
@pytest.mark.parametrize("kw", [dict(chunk_size=16, block_v=16), dict(chunk_size=32, block_v=32)])
def test_triton_chunk_and_value_blocks(variant, kw):
    """Several chunks per sequence, a sequence ending on a chunk edge, an empty one, two value blocks."""
    if variant != "triton_chunk":
        kw = {"block_v": kw["block_v"]}
    args = inputs.gated_delta_rule([40, 32, 0, 3], num_heads=2, head_k=16, head_v=32, seed=5)
    fn = functools.partial(kernels.get(OP, variant), **kw)
    assert check.check_one(fn, kernels.get(OP, "reference"), args) < check.TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype,narrow", [(torch.float32, False), (torch.float16, True)])
def test_the_recurrent_default_tile_follows_the_state_dtype_and_stays_correct(dtype, narrow):
    """The decode kernel's value block and warps are picked by the state's element size (a float32 state in
    64-column blocks, a 16-bit one in 32-column blocks of one warp); at head size 128, where either tile splits
    a head's state into several blocks, the default launch is within the dtype's tolerance of float64, and
    arguments given still pin the tile."""
    from kernels import gdn_triton
    state = torch.float16 if narrow else torch.float32
    block_v, warps = gdn_triton.recurrent_launch(state)
    assert (block_v, warps) == ((32, 1) if narrow else (64, 4))
    assert gdn_triton.recurrent_launch(state, block_v=16, num_warps=8) == (16, 8)
    args = inputs.gated_delta_rule([1, 1, 1], num_heads=2, head_k=16, head_v=128, slots=True, narrow_state=narrow,
                                   dtype=dtype, seed=21)
    assert args["initial_state"].dtype == state
    fn, ref = kernels.get(OP, "triton_recurrent"), kernels.get(OP, "reference")
    assert check.check_slots(fn, ref, args, OP) <= check.TOLERANCE[dtype]


def test_triton_rejects_head_sizes_it_cannot_tile():
    args = inputs.gated_delta_rule([4], num_heads=2, head_k=24, head_v=16, seed=0)
    with pytest.raises(ValueError, match="head size K"):
        kernels.get(OP, "triton_recurrent")(**args)


def test_shape_errors_name_the_argument():
    args = inputs.gated_delta_rule([4, 4], num_heads=4, num_k_heads=2, head_k=16, head_v=16, seed=0)
    fn = kernels.get(OP, "recurrent")
    for bad, match in [({"k": args["k"][..., :8]}, "k "), ({"v": args["v"][:, :, :3]}, "v must"),
                       ({"beta": args["beta"][:, :3]}, "beta"), ({"initial_state": args["initial_state"][:1]},
                                                                "initial_state"),
                       ({"cu_seqlens": torch.tensor([0, 4])}, "cu_seqlens"),
                       ({"state_slots": torch.tensor([0, 1])}, "state_slots needs initial_state")]:
        with pytest.raises(ValueError, match=match):
            fn(**{**args, **bad, **({"initial_state": None} if "state_slots" in bad else {})})


def _forgets_state(**kw):
    """Starts every call from a zero state: right on one call, wrong once a state is carried."""
    pool = kw.get("initial_state")
    if kw.get("state_slots") is not None:
        pool[kw["state_slots"].long()] = 0
    elif pool is not None:
        kw["initial_state"] = torch.zeros_like(pool)
    return kernels.get(OP, "recurrent")(**kw)


def _writes_no_state(**kw):
    if kw.get("state_slots") is None:
        return kernels.get(OP, "recurrent")(**kw)
    pool = kw["initial_state"]
    return kernels.get(OP, "recurrent")(**{**kw, "initial_state": pool.clone()})


def _clobbers_other_slots(**kw):
    out = kernels.get(OP, "recurrent")(**kw)
    if kw.get("state_slots") is not None:
        spare = [i for i in range(kw["initial_state"].shape[0]) if i not in kw["state_slots"].tolist()]
        kw["initial_state"][spare[0]] += 1
    return out


@pytest.mark.parametrize("bug", [_forgets_state, _writes_no_state, _clobbers_other_slots])
def test_the_check_fails_state_handling_bugs(bug):
    torch.manual_seed(0)
    failures = 0
    ref = kernels.get(OP, "reference")
    for shape in check.SMALL[OP]:
        try:
            err = check.check_shape(OP, bug, ref, shape, torch.float32, "cpu")
        except AssertionError:
            failures += 1
            continue
        failures += not err <= check.TOLERANCE[torch.float32]
    assert failures >= 1
