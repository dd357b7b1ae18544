"""Static decode steps: the buffers, padding and forward that CUDA graphs capture, run eagerly on
the CPU through the same code. Greedy tokens must equal the eager engine's (attention-only and
hybrid models), and padding rows must write nowhere but the scratch block and the scratch state slot."""
import pytest
import torch

from engine_helpers import tiny
from engine import LLM
from engine.config import ConfigError, load_config
from engine.cuda_graphs import SEQ_LENS, SLOT_BLOCKS, STATE_SLOTS, StaticDecodeInputs, bucket_sizes
from engine.model_runner import ModelRunner
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

MAX_TOKENS = 12


def _prompts():
    g = torch.Generator().manual_seed(99)
    shared = torch.randint(0, 512, (20,), generator=g).tolist()
    lens = [5, 17, 33, 1, 40, 9, 16]
    return [shared[:8] + torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]


PROMPTS = _prompts()


def test_buckets_cover_every_batch_size_up_to_the_maximum():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    for n in range(1, 300):
        sizes = bucket_sizes(n)
        assert sizes[-1] == n and sizes == sorted(set(sizes))


def _seq(rid, tokens, computed, blocks, slot=None):
    s = Sequence(rid, tokens, 4)
    s.num_computed_tokens, s.block_table, s.state_slot = computed, blocks, slot
    return s


def test_fill_pads_rows_to_the_scratch_block_and_repads_rows_a_larger_step_used():
    inp = StaticDecodeInputs(max_rows=8, max_blocks=4, block_size=4, scratch_block=9, device=torch.device("cpu"))
    a = ScheduledSeq(_seq("a", list(range(10, 20)), 9, [3, 5, 7]), 1)  # position 9: block 7, offset 1
    b = ScheduledSeq(_seq("b", [1, 2], 1, [2]), 1)
    c = ScheduledSeq(_seq("c", list(range(6)), 5, [0, 1]), 1)
    inp.fill([a, b, c], rows=4)
    meta = inp.meta[:, :4].tolist()
    assert meta == [[19, 2, 5, 0], [9, 1, 5, 0], [7, 2, 1, 9], [1, 1, 1, 0], [10, 2, 6, 1], [0, 0, 0, 0],
                    [-1, -1, -1, -1]]  # no row takes its input from a step on its way
    assert inp.tables[0, :3].tolist() == [3, 5, 7] and inp.tables[1, 0] == 2 and inp.tables[2, :2].tolist() == [0, 1]
    assert inp.tables[3, 0] == 9  # the padding row reads the scratch block only
    inp.fill([b], rows=2)  # a smaller step: row 1, used by c before, is padding again
    assert inp.meta[SLOT_BLOCKS, :2].tolist() == [2, 9] and inp.meta[SEQ_LENS, :2].tolist() == [2, 1]
    assert inp.tables[1, 0] == 9
    meta = inp.metadata(2)
    assert (meta.decode.start, meta.decode.end) == (0, 2) and meta.prefill is None and meta.decode_long is None
    assert meta.state is None  # no Gated DeltaNet layers


def test_fill_gives_each_row_its_state_slot_and_padding_the_scratch_one():
    inp = StaticDecodeInputs(max_rows=8, max_blocks=4, block_size=4, scratch_block=9, device=torch.device("cpu"),
                             scratch_state_slot=6)
    a = ScheduledSeq(_seq("a", list(range(10, 20)), 9, [3, 5, 7], slot=4), 1)
    b = ScheduledSeq(_seq("b", [1, 2], 1, [2], slot=0), 1)
    c = ScheduledSeq(_seq("c", list(range(6)), 5, [0, 1], slot=5), 1)
    inp.fill([a, b, c], rows=4)
    assert inp.meta[STATE_SLOTS, :4].tolist() == [4, 0, 5, 6]
    state = inp.metadata(4).state
    assert state.num_decode == 4 and state.decode_slots.tolist() == [4, 0, 5, 6]
    assert state.fresh_slots is None and state.prefill_slots is None and state.prefill_cu_seqlens is None
    assert state.decode_slots.data_ptr() == inp.meta[STATE_SLOTS].data_ptr()  # a view of the static buffer
    inp.fill([b], rows=2)
    assert inp.meta[STATE_SLOTS, :2].tolist() == [0, 6]  # row 1, a's before, is padding again


@pytest.fixture(scope="module")
def eager():
    return {model: LLM(tiny(model=model)).generate(PROMPTS, MAX_TOKENS) for model in ("tiny", "tiny-hybrid")}


def _static(**overrides) -> LLM:
    llm = LLM(tiny(**overrides))
    llm.engine.model_runner.use_static_decode(capture=False)
    return llm


GRAPH_SAFE = {"attention-decode": "v2_triton", "attention-decode-long": "v2_triton", "moe-dispatch": "triton"}
CASES = {
    "torch-kernels": {},
    "max-num-seqs-5": {"max-num-seqs": 5},  # buckets 1, 2, 4, 5: most steps are padded
    "prefix-caching-off": {"enable-prefix-caching": False},
    # a 48-token prompt decodes past the threshold in every step: those steps stay eager
    "long-decodes-on-another-kernel": {"decode-long-threshold": 30, "attention-decode-long": "v2"},
    "graph-safe-kernels": GRAPH_SAFE,
    # the hybrid model: state slots in the static buffers, padding rows on the scratch slot
    "hybrid": {"model": "tiny-hybrid"},
    "hybrid-max-num-seqs-5": {"model": "tiny-hybrid", "max-num-seqs": 5},
    "hybrid-gdn-decode-chunk": {"model": "tiny-hybrid", "gdn-decode": "chunk"},
    "hybrid-graph-safe-kernels": {"model": "tiny-hybrid", **GRAPH_SAFE, "gdn-decode": "triton_recurrent",
                                  "gdn-fused": "triton"},
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_static_decode_gives_the_eager_tokens(eager, overrides):
    llm = _static(**overrides)
    for key, value in overrides.items():
        if key in llm.kernel_choice:
            assert llm.kernel_choice[key] == value  # the variant under test really ran
    assert llm.generate(PROMPTS, MAX_TOKENS) == eager[overrides.get("model", "tiny")]
    graphs = llm.engine.model_runner.decode_graphs
    if "decode-long-threshold" in overrides:
        assert graphs.steps == 0
    else:
        assert graphs.steps >= MAX_TOKENS - 1  # decode steps really ran on the static buffers
    assert graphs.replays == 0  # nothing is captured on the CPU
    if llm.engine.config.hf.is_hybrid:  # every slot given back, none lost to the scratch slot
        assert llm.engine.scheduler.state_slots.num_free == llm.engine.config.max_num_seqs


def test_padding_rows_write_only_the_scratch_block():
    """Three decodes padded to a bucket of 4: every cache block but theirs and the scratch one keeps
    its bytes, and the tokens equal the eager step's."""
    runner = ModelRunner(load_config(tiny(**{"max-num-seqs": 4})))
    runner.use_static_decode(capture=False)
    seqs = [_seq(str(i), list(range(3 + i, 3 + i + n)), n - 1, [2 * i, 2 * i + 1]) for i, n in enumerate((5, 20, 17))]
    scheduled = [ScheduledSeq(s, 1) for s in seqs]
    layer = runner.attention_layers[0]
    for layer_ in runner.attention_layers:  # cache contents that the decodes attend to
        layer_.key_cache.normal_()
        layer_.value_cache.normal_()
    before = [(layer_.key_cache.clone(), layer_.value_cache.clone()) for layer_ in runner.attention_layers]
    static_tokens = runner.run(scheduled)
    assert runner.decode_graphs.bucket(3) == 4 and runner.decode_graphs.steps == 1
    written = {(s.block_table[s.num_computed_tokens // 16], s.num_computed_tokens % 16) for s in seqs}
    scratch = runner.num_blocks
    for (k0, v0), layer_ in zip(before, runner.attention_layers):
        for blk in range(runner.num_blocks):
            for off in range(16):
                same = torch.equal(layer_.key_cache[blk, :, :, off], k0[blk, :, :, off]) and \
                    torch.equal(layer_.value_cache[blk, :, :, off], v0[blk, :, :, off])
                assert same != ((blk, off) in written), (blk, off)
        assert not torch.equal(layer_.key_cache[scratch], k0[scratch])  # the padding row wrote here
    assert layer.key_cache.shape[0] == runner.num_blocks + 1
    runner.decode_graphs = None  # the same step, eagerly
    for (k0, v0), layer_ in zip(before, runner.attention_layers):
        layer_.key_cache.copy_(k0)
        layer_.value_cache.copy_(v0)
    assert runner.run(scheduled) == static_tokens


def test_padding_rows_of_a_hybrid_step_write_only_the_scratch_state_slot():
    """Three decodes in slots 4, 1 and 3 padded to a bucket of 4: every other state slot but the
    scratch one keeps its bytes in every Gated DeltaNet layer, and the tokens and the sequences'
    new states equal the eager step's."""
    runner = ModelRunner(load_config(tiny(model="tiny-hybrid", **{"max-num-seqs": 6})))
    runner.use_static_decode(capture=False)
    slots = (4, 1, 3)
    seqs = [_seq(str(i), list(range(3 + i, 3 + i + n)), n - 1, [2 * i, 2 * i + 1], slot)
            for i, (n, slot) in enumerate(zip((5, 20, 17), slots))]
    scheduled = [ScheduledSeq(s, 1) for s in seqs]
    layers = runner.linear_layers
    for t in [x for layer in layers for x in (layer.conv_state, layer.ssm_state)] + \
            [x for layer in runner.attention_layers for x in (layer.key_cache, layer.value_cache)]:
        t.normal_()  # history the decodes continue from
    before = [(layer.conv_state.clone(), layer.ssm_state.clone()) for layer in layers]
    kv = [(layer.key_cache.clone(), layer.value_cache.clone()) for layer in runner.attention_layers]
    static_tokens = runner.run(scheduled)
    assert runner.decode_graphs.bucket(3) == 4 and runner.decode_graphs.steps == 1
    scratch = runner.scratch_state_slot
    assert scratch == 6 and layers[0].ssm_state.shape[0] == 7
    static_states = [(layer.conv_state.clone(), layer.ssm_state.clone()) for layer in layers]
    for (conv0, ssm0), layer in zip(before, layers):
        for slot in range(scratch + 1):
            changed = not torch.equal(layer.ssm_state[slot], ssm0[slot])
            assert changed == (slot in slots + (scratch,)), slot
            assert (not torch.equal(layer.conv_state[slot], conv0[slot])) == changed, slot
    runner.decode_graphs = None  # the same step, eagerly
    for (conv0, ssm0), layer in zip(before, layers):
        layer.conv_state.copy_(conv0)
        layer.ssm_state.copy_(ssm0)
    for (k0, v0), layer in zip(kv, runner.attention_layers):
        layer.key_cache.copy_(k0)
        layer.value_cache.copy_(v0)
    assert runner.run(scheduled) == static_tokens
    for (conv, ssm), layer in zip(static_states, layers):
        for slot in slots:
            torch.testing.assert_close(layer.ssm_state[slot], ssm[slot])
            torch.testing.assert_close(layer.conv_state[slot], conv[slot])


def test_steps_with_a_prefill_or_more_rows_than_the_largest_bucket_stay_eager():
    runner = ModelRunner(load_config(tiny(**{"max-num-seqs": 2})))
    runner.use_static_decode(capture=False)
    decode = ScheduledSeq(_seq("d", [1, 2, 3], 2, [0]), 1)
    prefill = ScheduledSeq(_seq("p", [4, 5, 6], 0, [1]), 3)
    assert runner._static_decode_fits([decode]) and runner._static_decode_fits([decode, decode])
    assert not runner._static_decode_fits([decode, prefill])
    assert not runner._static_decode_fits([decode] * 3)


def test_a_hybrid_step_with_a_fresh_state_slot_stays_eager():
    """A one-token prompt is shaped like a decode, but its slot must be zeroed first: eager."""
    runner = ModelRunner(load_config(tiny(model="tiny-hybrid", **{"max-num-seqs": 2})))
    runner.use_static_decode(capture=False)
    decode = ScheduledSeq(_seq("d", [1, 2, 3], 2, [0], slot=0), 1)
    fresh = ScheduledSeq(_seq("f", [4], 0, [1], slot=1), 1)
    assert runner._static_decode_fits([decode])
    assert not runner._static_decode_fits([decode, fresh]) and not runner._static_decode_fits([fresh])
    assert runner.run([decode, fresh]) and runner.decode_graphs.steps == 0


def test_cuda_graphs_key_is_a_strict_boolean_and_the_cpu_captures_nothing():
    with pytest.raises(ConfigError, match="cuda-graphs"):
        load_config(tiny(**{"cuda-graphs": "yes"}))
    runner = ModelRunner(load_config(tiny(**{"cuda-graphs": True})))
    assert runner.decode_graphs is None and runner.graphs_off_reason is None


def test_kernels_that_wait_on_the_device_block_capture():
    runner = ModelRunner(load_config(tiny()))
    assert "attention-decode variant v1" in runner._graph_blocker()
    runner = ModelRunner(load_config(tiny(**{"attention-decode": "v2_triton", "moe-dispatch": "triton"})))
    assert runner._graph_blocker() is None
    hybrid = ModelRunner(load_config(tiny(model="tiny-hybrid", **{"attention-decode": "v2_triton",
                                                                  "moe-dispatch": "triton", "gdn-decode": "reference"})))
    assert "gdn-decode variant reference waits on the device" in hybrid._graph_blocker()
    hybrid = ModelRunner(load_config(tiny(model="tiny-hybrid", **{"attention-decode": "v2_triton",
                                                                  "moe-dispatch": "triton", "gdn-fused": "reference"})))
    assert "gdn-fused variant reference waits on the device (causal_conv1d" in hybrid._graph_blocker()
    hybrid = ModelRunner(load_config(tiny(model="tiny-hybrid", **{"attention-decode": "v2_triton",
                                                                  "moe-dispatch": "triton"})))
    assert hybrid._graph_blocker() is None  # the defaults gdn-decode recurrent and gdn-fused torch are graph-safe
    runner.model.static_decode = False  # a model whose decode reads more than the static buffers hold
    assert "declares no static decode path" in runner._graph_blocker()
