import torch

from engine_helpers import tiny
from engine.config import load_config
from engine.layers.attention import write_kv
from engine.layers.rotary_embedding import RotaryEmbedding
from kernels.norm_torch import rotate
from engine.model_runner import ModelRunner
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from kernels.paged import gather_native


def test_write_kv_uses_vllm_cache_layouts():
    kvh, d, bs, x = 2, 32, 4, 4
    kc = torch.zeros(6, kvh, d // x, bs, x)
    vc = torch.zeros(6, kvh, d, bs)
    k, v = torch.randn(5, kvh, d), torch.randn(5, kvh, d)
    blocks, offsets = torch.tensor([3, 3, 3, 3, 1]), torch.tensor([0, 1, 2, 3, 0])
    write_kv(k, v, kc, vc, blocks, offsets)
    gk, gv = gather_native(kc, vc, torch.tensor([[3, 1]]))  # [1, kvh, 2 * bs, d]
    assert torch.equal(gk[0, :, :5].transpose(0, 1), k)
    assert torch.equal(gv[0, :, :5].transpose(0, 1), v)
    assert kc[[0, 2, 4, 5]].abs().sum() == 0 and vc[[0, 2, 4, 5]].abs().sum() == 0


def test_partial_rotary_rotates_only_its_channels():
    rope = RotaryEmbedding(rotary_dim=8, base=10_000.0)
    x = torch.randn(3, 2, 32)
    cos, sin = rope.angles(torch.tensor([0, 1, 7]))
    y = rotate(x, cos, sin)
    assert torch.equal(y[0], x[0])  # position 0: no rotation
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert not torch.allclose(y[1:, :, :8], x[1:, :, :8])
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # a rotation keeps lengths


def test_batch_is_ordered_short_decodes_long_decodes_prefills():
    runner = ModelRunner(load_config(tiny(**{"decode-long-threshold": 20, "block-size": 16})))

    def seq(rid, n, computed, blocks):
        s = Sequence(rid, list(range(n)), 4)
        s.num_computed_tokens, s.block_table = computed, blocks
        return s

    prefill = ScheduledSeq(seq("p", 40, 16, [5, 6, 7]), 10)  # a middle chunk: no sample
    long_ = ScheduledSeq(seq("l", 30, 29, [1, 2]), 1)
    short = ScheduledSeq(seq("s", 5, 4, [3]), 1)
    ids, positions, meta, sample_rows = runner.prepare([prefill, long_, short])
    assert positions.tolist() == [4, 29] + list(range(16, 26))
    assert (meta.decode.start, meta.decode.end, meta.decode.seq_lens.tolist()) == (0, 1, [5])
    assert (meta.decode_long.start, meta.decode_long.end, meta.decode_long.seq_lens.tolist()) == (1, 2, [30])
    assert meta.prefill.start == 2
    assert meta.prefill.context_lens.tolist() == [16] and meta.prefill.query_start_loc.tolist() == [0, 10]
    assert meta.prefill.block_tables.tolist() == [[5]]
    assert meta.slot_blocks.tolist() == [3, 2] + [6] * 10
    assert meta.slot_offsets.tolist() == [4, 13] + list(range(0, 10))
    assert sample_rows == [(0, 2), (1, 1)]  # batch row -> index in the scheduled list
    out = runner.run([prefill, long_, short])
    assert out[0] is None and all(isinstance(t, int) for t in out[1:])
