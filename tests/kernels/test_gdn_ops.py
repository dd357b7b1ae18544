"""The Gated DeltaNet layer's convolution, gates and gated RMSNorm: the float64 references against
independent formulations, every variant against them (Triton under TRITON_INTERPRET=1, conftest.py)
with every output element written, the engine's prefill-then-decode pattern on a slot pool, no
host sync in a decode step, and the check failing the bugs it is there to catch."""
import contextlib
import functools

import numpy as np
import pytest
import torch

import kernels
from kernels import check, inputs

OPS = ("causal_conv1d", "gdn_gating", "rms_norm_gated")
VARIANTS = [(op, v) for op in OPS for v in kernels.variants(op)[1:]]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_conv_reference_matches_a_numpy_convolution():
    args = check.as_float64(inputs.causal_conv1d([7, 1, 2, 4], channels=5, seed=3))
    pool = args["conv_state"].clone()
    out = kernels.get("causal_conv1d", "reference")(**args)
    x, w = args["x"][0].numpy(), args["weight"].numpy()
    cu = args["cu_seqlens"].tolist()
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        slot = int(args["state_slots"][n])
        seq = np.concatenate([pool[slot].numpy().T, x[a:b]])  # [3 + tokens, channels], oldest first
        for t in range(b - a):
            want = (seq[t:t + 4] * w.T).sum(0)
            np.testing.assert_allclose(out[0, a + t].numpy(), want / (1 + np.exp(-want)), rtol=1e-12)
        np.testing.assert_array_equal(args["conv_state"][slot].numpy(), seq[-3:].T)
    untouched = [i for i in range(pool.shape[0]) if i not in args["state_slots"].tolist()]
    assert torch.equal(args["conv_state"][untouched], pool[untouched])


def test_gating_and_norm_references_match_their_formulas():
    args = check.as_float64(inputs.gdn_gating(5, num_heads=6, seed=2))
    g, beta = kernels.get("gdn_gating", "reference")(**args)
    x = args["a"].numpy() + args["dt_bias"].numpy()
    softplus = np.where(x > 20, x, np.logaddexp(0, x))
    np.testing.assert_allclose(g.numpy(), -np.exp(args["A_log"].numpy()) * softplus, rtol=1e-12)
    np.testing.assert_allclose(beta.numpy(), 1 / (1 + np.exp(-args["b"].numpy())), rtol=1e-12)
    args = check.as_float64(inputs.rms_norm_gated(3, num_heads=2, head_size=8, seed=2))
    out = kernels.get("rms_norm_gated", "reference")(**args)
    x, z = args["x"].numpy(), args["gate"].numpy()
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * args["weight"].numpy() * z / (1 + np.exp(-z))
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,variant", VARIANTS)
def test_small_shape_list(op, variant, dtype):
    result = check.run(op, variant, "cpu", dtype, small=True)
    assert result["passed"], result


@pytest.mark.parametrize("op", OPS)
def test_torch_variants_on_the_full_shape_list(op):
    result = check.run(op, "torch", "cpu", torch.float32)
    assert result["passed"] and result["worst_error"] < 1e-5, result


@contextlib.contextmanager
def nan_allocations():
    """Every floating-point tensor torch.empty / empty_like hands out is NaN: an output element no
    program writes shows (what kernels.check's poisoning does on CUDA)."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = lambda *a, **k: fill(empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


SEVERAL_PROGRAMS = {  # each with a ragged last block of channels, tokens (64 a block) or rows
    "causal_conv1d": (dict(seq_lens=[19, 1, 2, 150], channels=40), dict(block_c=16)),
    "gdn_gating": (dict(tokens=37, num_heads=20), dict(block_t=8)),
    "rms_norm_gated": (dict(tokens=9, num_heads=5, head_size=48), dict(block_r=8)),
}


@pytest.mark.parametrize("op", OPS)
def test_triton_writes_every_output_element(op):
    shape, blocks = SEVERAL_PROGRAMS[op]
    args = getattr(inputs, op)(**shape, seed=4)
    fn = functools.partial(kernels.get(op, "triton"), **blocks)
    with nan_allocations():
        err = check.check_one(fn, kernels.get(op, "reference"), args, op)
    assert err < check.TOLERANCE[torch.float32], err


def _skips_the_last_channel_block(**kw):
    """A convolution that leaves the channels of its last block unwritten and their states as they were."""
    c = kw["x"].shape[2] - 4
    out = torch.empty(kw["x"].shape)
    out[..., :c] = kernels.get("causal_conv1d", "triton")(**{**kw, "x": kw["x"][..., :c], "weight": kw["weight"][:c],
                                                             "conv_state": kw["conv_state"][:, :c].contiguous()})
    return out


def test_poisoned_allocations_catch_an_unwritten_output():
    args = inputs.causal_conv1d([3, 1], channels=20, seed=1)
    with nan_allocations():
        err = check.check_one(_skips_the_last_channel_block, kernels.get("causal_conv1d", "reference"), args)
    assert err != err


@pytest.mark.parametrize("variant", ["torch", "triton"])
def test_conv_prefill_chunks_then_decode_steps_equal_one_call_over_all_tokens(variant):
    """The engine's pattern: two packed prefill chunks (the second continuing from the pool, a
    one-token sequence with nothing left for it), then decode steps [B, 1]; slots no sequence
    holds stay NaN."""
    lens, steps = [9, 1, 5], 3
    full = inputs.causal_conv1d([n + steps for n in lens], channels=40, seed=6)
    ref = kernels.get("causal_conv1d", "reference")
    ref_args = check.as_float64(full)
    ref_pool = ref_args["conv_state"]
    ref_out = ref(**ref_args)[0]
    pool = torch.full_like(full["conv_state"], float("nan"))
    slots = full["state_slots"]
    pool[slots] = full["conv_state"][slots]
    fn = kernels.get("causal_conv1d", variant)
    cu = full["cu_seqlens"].tolist()
    x = full["x"][0]
    for lo, hi in ((0, 4), (4, None)):
        parts = [(a + min(lo, n), a + (n if hi is None else min(hi, n))) for a, n in zip(cu[:-1], lens)]
        idx = torch.cat([torch.arange(a, b) for a, b in parts])
        starts = torch.tensor([0] + list(np.cumsum([b - a for a, b in parts])), dtype=torch.int32)
        out = fn(x[idx][None], full["weight"], pool, slots, starts)
        torch.testing.assert_close(out[0].double(), ref_out[idx], rtol=1e-5, atol=1e-6)
    for t in range(steps):
        idx = torch.tensor([a + n + t for a, n in zip(cu[:-1], lens)])
        out = fn(x[idx][:, None], full["weight"], pool, slots)
        torch.testing.assert_close(out[:, 0].double(), ref_out[idx], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool[slots].double(), ref_pool[slots])
    rest = [i for i in range(pool.shape[0]) if i not in slots.tolist()]
    assert torch.isnan(pool[rest]).all()


@pytest.mark.parametrize("variant", ["torch", "triton"])
def test_gates_are_exact_to_float32_in_both_tails_of_the_softplus(variant):
    """softplus(x) is x above 20 and e^x far below 0, where log(1 + e^x) in float32 would give 0."""
    a = torch.tensor([[-60.0, -30.0, -17.0, -1e-3, 0.0, 5.0, 19.9, 20.5, 45.0]])
    zeros = torch.zeros(a.shape[1])
    g, beta = kernels.get("gdn_gating", variant)(a, a.clone(), zeros, zeros)
    ref, _ = kernels.get("gdn_gating", "reference")(a.double(), a.double(), zeros.double(), zeros.double())
    torch.testing.assert_close(g.double(), ref.double(), rtol=1e-6, atol=0)
    assert g.dtype == torch.float32 and beta.dtype == torch.float32


@pytest.mark.parametrize("variant", ["torch", "triton"])
def test_gates_keep_beta_in_the_activations_dtype_and_decays_in_float32(variant):
    args = inputs.gdn_gating(4, num_heads=8, dtype=torch.float16, seed=0)
    g, beta = kernels.get("gdn_gating", variant)(**args)
    assert (g.dtype, beta.dtype) == (torch.float32, torch.float16) and g.is_contiguous() and beta.is_contiguous()


def test_the_check_holds_gates_to_their_dtypes():
    def beta_in_float32(**kw):
        g, beta = kernels.get("gdn_gating", "torch")(**kw)
        return g, beta.float()
    args = inputs.gdn_gating(4, num_heads=8, dtype=torch.float16, seed=0)
    with pytest.raises(AssertionError, match="float32, float16"):
        check.check_one(beta_in_float32, kernels.get("gdn_gating", "reference"), args, "gdn_gating")


def _conv_forgets_state(**kw):
    kw["conv_state"][kw["state_slots"].long()] = 0
    return kernels.get("causal_conv1d", "torch")(**kw)


def _conv_writes_no_state(**kw):
    return kernels.get("causal_conv1d", "torch")(**{**kw, "conv_state": kw["conv_state"].clone()})


def _conv_clobbers_other_slots(**kw):
    out = kernels.get("causal_conv1d", "torch")(**kw)
    spare = [i for i in range(kw["conv_state"].shape[0]) if i not in kw["state_slots"].tolist()]
    kw["conv_state"][spare[0]] += 1
    return out


@pytest.mark.parametrize("bug", [_conv_forgets_state, _conv_writes_no_state, _conv_clobbers_other_slots])
def test_the_check_fails_conv_state_bugs(bug):
    ref = kernels.get("causal_conv1d", "reference")
    failures = 0
    for shape in check.SMALL["causal_conv1d"]:
        try:
            err = check.check_shape("causal_conv1d", bug, ref, shape, torch.float32, "cpu")
        except AssertionError:
            failures += 1
            continue
        failures += not err <= check.TOLERANCE[torch.float32]
    assert failures == len(check.SMALL["causal_conv1d"])


@pytest.mark.parametrize("variant", ["torch", "triton"])
def test_a_decode_step_reads_nothing_back_to_the_host(variant):
    """What lets a CUDA graph capture it: no .item() / .tolist(), and a few launches at most."""
    from kernels.launches import Launches

    calls = {"causal_conv1d": inputs.causal_conv1d([1, 1, 1], channels=32, seed=0),
             "gdn_gating": inputs.gdn_gating(3, num_heads=4, seed=0),
             "rms_norm_gated": inputs.rms_norm_gated(3, num_heads=4, head_size=16, seed=0)}
    for op, args in calls.items():
        assert kernels.graph_safe(op, variant)
        fn = kernels.get(op, variant)
        with Launches() as launches:
            fn(**args)
        assert launches.syncs == 0, op
        if variant == "triton":
            assert len(launches.kernels) == 1 and launches.kernels[0].startswith("triton:"), launches.kernels


def test_shape_errors_name_the_argument():
    conv = inputs.causal_conv1d([2, 3], channels=8, seed=0)
    for bad, match in [({"weight": conv["weight"][:4]}, "weight"), ({"conv_state": conv["conv_state"][:, :4]},
                                                                    "conv_state"),
                       ({"state_slots": conv["state_slots"][:1]}, "state_slots"),
                       ({"cu_seqlens": conv["cu_seqlens"].float()}, "cu_seqlens")]:
        for variant in ("torch", "triton"):
            with pytest.raises(ValueError, match=match):
                kernels.get("causal_conv1d", variant)(**{**conv, **bad})
    gates = inputs.gdn_gating(2, num_heads=4, seed=0)
    with pytest.raises(ValueError, match="A_log"):
        kernels.get("gdn_gating", "triton")(**{**gates, "A_log": gates["A_log"][:2]})
    norm = inputs.rms_norm_gated(2, num_heads=2, head_size=8, seed=0)
    with pytest.raises(ValueError, match="gate"):
        kernels.get("rms_norm_gated", "triton")(**{**norm, "gate": norm["gate"][:, :1]})
