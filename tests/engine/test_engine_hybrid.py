"""The hybrid model (``tiny-hybrid``: three Gated DeltaNet layers, then attention): greedy outputs
must not depend on batching, chunking, preemption or the GDN kernel variants, and must be what a
plain float64 forward pass picks; each running sequence holds one state slot, given back when it
finishes or is preempted."""
import pytest

import kernels
from engine_helpers import invariance_prompts, tiny
from engine_dense_reference import forward
from engine import LLM
from engine.config import KERNEL_KEYS, key_variants

MAX_TOKENS = 12
PROMPTS = invariance_prompts()
REFERENCE = {key: "reference" for key in KERNEL_KEYS}


def hybrid(**overrides) -> dict:
    return tiny(model="tiny-hybrid", **overrides)


@pytest.fixture(scope="module")
def expected():
    llm = LLM(hybrid(**REFERENCE))
    return llm, llm.generate(PROMPTS, MAX_TOKENS)


def test_reference_engine_matches_a_dense_forward_with_clear_margins(expected):
    llm, outputs = expected
    model = llm.engine.model_runner.model
    assert [type(layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn).__name__
            for layer in model.layers] == ["GatedDeltaNet"] * 3 + ["Attention"]
    worst_logit_margin, worst_route_gap = float("inf"), float("inf")
    for prompt, out in zip(PROMPTS, outputs):
        assert len(out) == MAX_TOKENS
        logits, gaps = forward(model, prompt + out[:-1])
        picked = logits[len(prompt) - 1:]
        assert picked.argmax(-1).tolist() == out
        top2 = picked.topk(2, dim=-1).values
        worst_logit_margin = min(worst_logit_margin, float((top2[:, 0] - top2[:, 1]).min()))
        worst_route_gap = min(worst_route_gap, float(gaps.min()))
    assert worst_logit_margin > 1e-2, worst_logit_margin
    assert worst_route_gap > 1e-5, worst_route_gap
    assert len({tuple(o) for o in outputs}) == len(outputs)


def test_the_state_matters(expected):
    """A model whose outputs ignore its recurrent state would pass every test below: this one's do not."""
    llm = LLM(hybrid(**REFERENCE))
    for layer in llm.engine.model_runner.linear_layers:
        layer.A_log.data.fill_(10.0)  # decay exp(-e^10 ...) = 0: each token forgets all before it
    assert llm.generate(PROMPTS, MAX_TOKENS) != expected[1]


# The defaults (gdn-prefill chunk, gdn-decode recurrent, gdn-fused torch) run in every case without a
# gdn key; the Triton variants run together, as the gdn plugins ship them (each under the
# interpreter is slow), and the fused ones also with the torch recurrences.
CASES = [
    ("max-num-seqs-1", {"max-num-seqs": 1}),
    ("max-num-seqs-3", {"max-num-seqs": 3}),
    ("chunk-every-prefill", {"max-num-batched-tokens": 13}),
    ("gdn-prefill-recurrent", {"gdn-prefill": "recurrent"}),
    ("gdn-decode-chunk", {"gdn-decode": "chunk"}),
    ("gdn-fused-triton", {"gdn-fused": "triton", "max-num-batched-tokens": 13}),
    ("gdn-triton", {"gdn-prefill": "triton_chunk", "gdn-decode": "triton_recurrent", "gdn-fused": "triton"}),
]


def test_every_gdn_variant_is_covered():
    covered = {"chunk", "recurrent"} | {v for _, c in CASES for k, v in c.items() if k in ("gdn-prefill", "gdn-decode")}
    assert covered == set(kernels.variants("gated_delta_rule")[1:])
    fused = {"torch"} | {c["gdn-fused"] for _, c in CASES if "gdn-fused" in c}
    assert fused == set(key_variants("gdn-fused")) - {"reference"}


@pytest.mark.parametrize("overrides", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_outputs_are_identical(expected, overrides):
    llm = LLM(hybrid(**overrides))
    for key, value in overrides.items():
        if key in llm.kernel_choice:
            assert llm.kernel_choice[key] == value  # the variant under test really ran
    assert llm.generate(PROMPTS, MAX_TOKENS) == expected[1]
    slots = llm.engine.scheduler.state_slots
    assert slots.num_free == llm.engine.model_runner.num_state_slots == llm.engine.config.max_num_seqs


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_recurrent_state_takes_half_the_memory_and_picks_the_same_tokens(expected, dtype):
    """``mamba-ssm-cache-dtype``: the recurrent state pool in 16 bits (the convolution's stays in the model's
    dtype), half its bytes; this model's logit margins (over 1e-2) are wider than the state's rounding."""
    import torch

    wide = LLM(hybrid()).engine.model_runner.linear_layers
    llm = LLM(hybrid(**{"mamba-ssm-cache-dtype": dtype}))
    layers = llm.engine.model_runner.linear_layers
    assert all(layer.ssm_state.dtype == getattr(torch, dtype) and layer.conv_state.dtype == torch.float32
               for layer in layers)
    assert [2 * layer.ssm_state.nbytes for layer in layers] == [layer.ssm_state.nbytes for layer in wide]
    assert llm.generate(PROMPTS, MAX_TOKENS) == expected[1]


def test_preempted_sequences_recompute_their_state_from_scratch(expected):
    # 8 blocks of 16 (512 bytes a token: one attention layer) = one sequence of max-model-len 128
    llm = LLM(hybrid(**{"max-model-len": 128, "kv-cache-memory": 8 * 16 * 512}))
    assert llm.engine.model_runner.num_blocks == 8
    assert llm.generate(PROMPTS, MAX_TOKENS) == expected[1]
    assert llm.engine.stats["preemptions"] > 0
    assert llm.engine.scheduler.state_slots.num_free == 8


def test_prefix_caching_is_off_for_a_hybrid_model(expected):
    llm = LLM(hybrid(**{"enable-prefix-caching": True}))
    assert not llm.engine.config.prefix_caching and not llm.engine.scheduler.block_manager.enable_prefix_caching
    assert llm.generate(PROMPTS, MAX_TOKENS) == expected[1]
    assert llm.engine.stats["prefix_cache_hits"] == 0


def test_the_kv_cache_holds_attention_layers_only():
    runner = LLM(hybrid()).engine.model_runner
    assert len(runner.attention_layers) == 1 and len(runner.linear_layers) == 3
    dense = LLM(tiny(**{"num-layers": 4})).engine.model_runner
    assert runner._block_bytes() * 4 == dense._block_bytes()
    assert runner.num_blocks == 4 * dense.num_blocks  # the same kv-cache-memory holds 4x the tokens


def test_batch_rows_read_and_write_their_sequences_slots():
    from engine.config import load_config
    from engine.model_runner import ModelRunner
    from engine.scheduler import ScheduledSeq
    from engine.sequence import Sequence

    runner = ModelRunner(load_config(hybrid(**{"decode-long-threshold": 20})))

    def seq(rid, n, computed, blocks, slot):
        s = Sequence(rid, list(range(n)), 4)
        s.num_computed_tokens, s.block_table, s.state_slot = computed, blocks, slot
        return s

    prefill = ScheduledSeq(seq("p", 40, 16, [5, 6, 7], slot=6), 10)
    fresh_prefill = ScheduledSeq(seq("f", 9, 0, [8], slot=1), 9)
    long_ = ScheduledSeq(seq("l", 30, 29, [1, 2], slot=4), 1)
    one_token_prompt = ScheduledSeq(seq("o", 1, 0, [3], slot=2), 1)  # a decode row computing its first token
    _, _, meta, _ = runner.prepare([prefill, long_, fresh_prefill, one_token_prompt])
    st = meta.state
    assert st.num_decode == 2 and st.decode_slots.tolist() == [2, 4]  # short decodes, then long ones
    assert st.prefill_slots.tolist() == [6, 1] and st.prefill_cu_seqlens.tolist() == [0, 10, 19]
    assert sorted(st.fresh_slots.tolist()) == [1, 2]
    decode_only = runner.prepare([long_])[2].state
    assert decode_only.fresh_slots is None and decode_only.prefill_slots is None


def test_abort_gives_the_slot_back():
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(hybrid(**{"max-num-seqs": 2}))
    a = engine.add_request(list(range(30)), 5)
    engine.add_request(list(range(9)), 5)
    engine.step()
    assert engine.scheduler.state_slots.num_free == 0
    engine.abort(a)
    assert engine.scheduler.state_slots.num_free == 1
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.state_slots.num_free == 2
