"""Every torch variant against the float64 reference over the check's full shape list."""
import pytest
import torch

import kernels
from kernels import check, inputs

TORCH_VARIANTS = [("paged_decode", "v1"), ("paged_decode", "v2"), ("paged_decode", "v2_layout"),
                  ("prefix_prefill", "loop"), ("prefix_prefill", "pregather"),
                  ("moe", "gather"), ("moe", "sorted"), ("moe", "grouped_mm"),
                  ("rms_norm", "torch"), ("qk_norm_rope", "torch"),
                  ("gated_delta_rule", "recurrent"), ("gated_delta_rule", "chunk")]


@pytest.mark.parametrize("op,variant", TORCH_VARIANTS)
def test_full_shape_list_float32(op, variant):
    result = check.run(op, variant, "cpu", torch.float32)
    assert result["passed"], result
    assert result["worst_error"] < 1e-5


@pytest.mark.parametrize("op,variant", TORCH_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_small_shapes_low_precision(op, variant, dtype):
    result = check.run(op, variant, "cpu", dtype, small=True)
    assert result["passed"], result


@pytest.mark.parametrize("block_m", [1, 7, 64])
@pytest.mark.parametrize("variant", ["loop", "pregather"])
def test_prefill_tile_size_does_not_change_the_result(variant, block_m):
    args = inputs.prefix_prefill([(20, 30), (0, 9)], num_heads=4, num_kv_heads=2, head_size=16, block_size=8, seed=1)
    ref = kernels.get("prefix_prefill", "reference")(**check.as_float64(args))
    out = kernels.get("prefix_prefill", variant)(**args, block_m=block_m, block_n=32, num_warps=4)
    assert check.rel_error(out, ref) < 1e-5


def test_decode_variants_agree_across_partition_edges():
    args = inputs.paged_decode([511, 512, 513, 1025], num_heads=4, num_kv_heads=1, head_size=16, seed=2)
    outs = [kernels.get("paged_decode", v)(**args) for v in ("v1", "v2", "v2_layout")]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1], outs[2], rtol=0, atol=0)


def test_moe_without_renormalisation_scales_by_raw_probabilities():
    args = inputs.moe(9, hidden=32, experts=8, intermediate=16, top_k=2, seed=3)
    ref = kernels.get("moe", "reference")(**check.as_float64(args), renormalize=False)
    ref_norm = kernels.get("moe", "reference")(**check.as_float64(args))
    assert check.rel_error(ref, ref_norm) > 1e-2  # the flag matters on these inputs
    for v in ("gather", "sorted"):
        assert check.rel_error(kernels.get("moe", v)(**args, renormalize=False), ref) < 1e-5


def test_shape_errors_name_the_argument():
    args = inputs.paged_decode([5], num_heads=4, num_kv_heads=2, head_size=16, seed=0)
    with pytest.raises(ValueError, match="value_cache"):
        kernels.get("paged_decode", "v1")(**{**args, "value_cache": args["value_cache"][..., :3]})
    pre = inputs.prefix_prefill([(3, 4)], num_heads=4, num_kv_heads=2, head_size=16, seed=0)
    with pytest.raises(ValueError, match="query_start_loc"):
        kernels.get("prefix_prefill", "loop")(**{**pre, "query_start_loc": pre["query_start_loc"][:1]})
    moe = inputs.moe(3, hidden=16, experts=4, intermediate=8, top_k=2, seed=0)
    with pytest.raises(ValueError, match="w2"):
        kernels.get("moe", "sorted")(**{**moe, "w2": moe["w2"][:, :, :4]})
    with pytest.raises(ValueError, match="top_k"):
        kernels.get("moe", "gather")(**{**moe, "top_k": 5})


def test_sort_by_expert_is_stable_and_counts_every_expert():
    from kernels.routing import sort_by_expert
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    order, counts = sort_by_expert(ids, num_experts=5)
    assert counts.tolist() == [2, 1, 0, 3, 0]
    assert order.tolist() == [1, 4, 3, 0, 2, 5]
