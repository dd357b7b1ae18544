"""The GPU model runner's warm-up: throwaway steps of every kind and size class, so that Triton compiles each
kernel variant before the first request. The steps must stay inside the runner's limits, reach every band of the
MoE launch table the scheduler's step sizes can reach, and change nothing a request then computes."""
import pytest
import torch

from engine_helpers import tiny
from engine import LLM, warm_up
from engine.config import KERNEL_KEYS
from kernels.moe_triton import TABLE

PROMPTS = [[7, 3, 9], list(range(40, 73)), [5], list(range(100, 117))]


def test_token_counts_hold_both_residues_of_16_at_every_scale():
    counts = warm_up.token_counts(8192)
    assert counts[:6] == [1, 2, 3, 4, 5, 8] and counts[-1] == 8192 and counts == sorted(set(counts))
    for p in (16, 32, 256, 4096):
        assert p in counts and p + 1 in counts
    assert warm_up.token_counts(1) == [1] and warm_up.token_counts(20) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 20]


@pytest.mark.parametrize("experts,top_k", [(257, 9), (256, 8), (64, 4), (8, 2)])
def test_every_moe_table_band_the_steps_reach_is_warmed(experts, top_k):
    """A band of rows per expert that some step size up to the limit falls in holds a warmed size (the tables'
    bounds are more than twice apart)."""
    limit = 8192

    def band(tokens):
        return next(i for i, row in enumerate(TABLE) if tokens * top_k / experts <= row[0])

    reached = {band(t) for t in range(1, limit + 1)}
    assert {band(t) for t in warm_up.token_counts(limit)} == reached


@pytest.mark.parametrize("threshold", [None, 40])
def test_the_plan_stays_inside_the_runners_limits(threshold):
    steps = warm_up.plan(max_tokens=64, max_seqs=20, max_model_len=96, block_size=8, num_blocks=30, num_slots=20,
                         compiled=set(KERNEL_KEYS), long_threshold=threshold)
    kinds = set()
    for step in steps:
        assert sum(s.num_new_tokens for s in step) <= 64 and len(step) <= 20
        slots = [s.seq.state_slot for s in step]
        assert len(set(slots)) == len(slots) and all(0 <= x < 20 for x in slots)
        for s in step:
            assert len(s.seq) <= 96 and s.samples
            assert len(s.seq.block_table) * 8 >= len(s.seq) and all(0 <= b < 30 for b in s.seq.block_table)
        decode = [s for s in step if s.num_new_tokens == 1]
        prefill = [s for s in step if s.num_new_tokens > 1]
        kinds.add((bool(decode), bool(prefill), any(s.seq.num_computed_tokens > 0 for s in prefill),
                   any(s.seq.num_computed_tokens >= 40 for s in decode)))
    decode_sizes = {len(step) for step in steps if all(s.num_new_tokens == 1 for s in step)}
    assert decode_sizes >= {1, 2, 16, 17, 20}
    assert (True, True, True, False) in kinds  # mixed: decode rows, then a chunk after its context
    assert (False, True, False, False) in kinds and (False, True, True, False) in kinds
    assert ((True, False, False, True) in kinds) == (threshold is not None)


def test_only_triton_kernels_are_warmed_and_only_by_the_steps_they_see():
    """A server start pays for every throwaway step, so the plan holds only what a Triton variant compiles on."""
    assert warm_up.compiled_keys({"moe-dispatch": "sorted", "attention-decode": "v1", "rms-norm": "torch"}) == set()
    assert warm_up.compiled_keys({"moe-dispatch": "triton", "attention-decode": "v2_triton",
                                  "rms-norm": "torch"}) == {"moe-dispatch", "attention-decode"}
    limits = dict(max_tokens=64, max_seqs=20, max_model_len=600, block_size=8, num_blocks=30, num_slots=20)
    assert warm_up.plan(**limits, compiled=set()) == []

    def contexts(steps):  # the decode rows' contexts, and whether a prompt follows a cached context
        return ({s.seq.num_computed_tokens for step in steps for s in step if s.num_new_tokens == 1},
                any(s.seq.num_computed_tokens for step in steps for s in step if s.num_new_tokens > 1
                    and len(step) == 1))

    moe = warm_up.plan(**limits, compiled={"moe-dispatch"})
    full = warm_up.plan(**limits, compiled={"moe-dispatch", "attention-decode", "attention-prefill"})
    assert contexts(moe) == ({0, 8, 17}, False)  # a 1-token prompt, one decode context, the mixed steps
    assert contexts(full)[0] > {0, 8, 17} and contexts(full)[1]
    assert len(moe) < len(full)
    # every token count a step can have is still warmed for the MoE
    assert {sum(s.num_new_tokens for s in step) for step in moe} >= set(warm_up.token_counts(64))


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_a_warmed_runner_generates_what_a_fresh_one_does(model, monkeypatch):
    fresh = LLM(tiny(model=model)).generate(PROMPTS, 8)
    warmed = LLM(tiny(model=model))
    runner = warmed.engine.model_runner
    monkeypatch.setattr(warm_up, "compiled_keys", lambda choice: set(choice))  # as if every variant compiled
    before = [layer.key_cache.clone() for layer in runner.attention_layers]
    assert warm_up.run(runner) > 0
    # the steps wrote into the cache (so they ran), and a request reads none of it
    assert any(not torch.equal(b, layer.key_cache) for b, layer in zip(before, runner.attention_layers))
    assert warmed.generate(PROMPTS, 8) == fresh
