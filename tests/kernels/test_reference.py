"""The float64 references against independent formulations (contiguous caches, dense MoE)."""
import torch
import torch.nn.functional as F

import kernels
from kernels import inputs
from kernels.check import as_float64


def _contiguous_kv(args, s, n):
    """Sequence ``s``'s first n cached tokens as [kv_heads, n, d], read token by token through the layouts."""
    kc, vc, bt = args["key_cache"], args["value_cache"], args["block_tables"]
    bs, x, d = kc.shape[3], kc.shape[4], vc.shape[2]
    k = torch.zeros(kc.shape[1], n, d, dtype=torch.float64)
    v = torch.zeros(kc.shape[1], n, d, dtype=torch.float64)
    for t in range(n):
        blk, off = int(bt[s, t // bs]), t % bs
        for j in range(d):
            k[:, t, j] = kc[blk, :, j // x, off, j % x]
        v[:, t] = vc[blk, :, :, off]
    return k, v


def test_decode_reference_matches_sdpa_on_contiguous_cache():
    args = inputs.paged_decode([5, 19], num_heads=4, num_kv_heads=2, head_size=8, block_size=4, seed=3)
    out = kernels.get("paged_decode", "reference")(**as_float64(args))
    for s, n in enumerate([5, 19]):
        k, v = _contiguous_kv(args, s, n)
        q = args["query"][s].double()[:, None]  # [H, 1, d]
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0),
                                              scale=args["scale"])[:, 0]
        torch.testing.assert_close(out[s], want)


def test_prefill_reference_matches_sdpa_with_explicit_mask():
    seqs = [(6, 3), (0, 4)]
    args = inputs.prefix_prefill(seqs, num_heads=2, num_kv_heads=1, head_size=8, block_size=4, seed=4)
    out = kernels.get("prefix_prefill", "reference")(**as_float64(args))
    a = 0
    for s, (c, n) in enumerate(seqs):
        ck, cv = _contiguous_kv(args, s, c)
        k = torch.cat([ck, args["key"][a:a + n].double().transpose(0, 1)], 1).repeat_interleave(2, 0)
        v = torch.cat([cv, args["value"][a:a + n].double().transpose(0, 1)], 1).repeat_interleave(2, 0)
        mask = torch.ones(n, c + n, dtype=torch.bool).tril(diagonal=c)
        q = args["query"][a:a + n].double().transpose(0, 1)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=args["scale"]).transpose(0, 1)
        torch.testing.assert_close(out[a:a + n], want)
        a += n


def test_moe_reference_matches_dense_formulation():
    args = inputs.moe(6, hidden=16, experts=5, intermediate=8, top_k=2, seed=5)
    out = kernels.get("moe", "reference")(**as_float64(args))
    x, w13, w2 = args["hidden_states"].double(), args["w13"].double(), args["w2"].double()
    probs = torch.softmax(args["router_logits"].float(), -1)
    top_w, top_i = probs.topk(2, -1)
    dense = torch.zeros(6, 5, dtype=torch.float64)  # every expert on every token, weighted by its share
    dense.scatter_(1, top_i, (top_w / top_w.sum(-1, keepdim=True)).double())
    gate_up = torch.einsum("eoh,th->teo", w13, x)
    y = torch.einsum("ehi,tei->teh", w2, F.silu(gate_up[..., :8]) * gate_up[..., 8:])
    torch.testing.assert_close(out, (dense[..., None] * y).sum(1))


def test_reference_returns_input_dtype():
    args = inputs.moe(3, hidden=16, experts=4, intermediate=8, top_k=2, dtype=torch.float16, seed=6)
    assert kernels.get("moe", "reference")(**args).dtype == torch.float16
