"""The engine's model computed plainly in float64: whole sequences, causal attention without a
cache, Gated DeltaNet layers as one convolution over the sequence and the reference recurrence,
the reference MoE. What the paged, batched, chunked engine must agree with."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _rope(x, positions, rotary_dim, theta):
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    f = positions.double()[:, None] * inv[None]
    cos, sin = f.cos()[:, None], f.sin()[:, None]
    x1, x2 = x[..., :rotary_dim].chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]), -1)


def forward(model, tokens: list[int]):
    """(logits [T, vocab], routing gaps [layers, T]): the gap between the k-th and (k+1)-th router
    probability, i.e. how far each token is from switching experts."""
    cfg = model.config
    t, eps = len(tokens), cfg.rms_norm_eps
    pos = torch.arange(t)
    x = model.embed_tokens[torch.tensor(tokens)].double()
    gaps = []
    moe_ref = kernels.get("moe", "reference")
    for layer in model.layers:
        h = _rms(x, layer.input_norm.weight, eps)
        if hasattr(layer, "linear_attn"):
            x = x + _gated_deltanet(layer.linear_attn, h, eps)
        else:
            x = x + _attention(layer.self_attn, cfg, h, pos)
        h = _rms(x, layer.post_attention_norm.weight, eps)
        m = layer.mlp
        logits = h @ m.router.double().T
        probs = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
        gaps.append(probs[:, cfg.top_k - 1] - probs[:, cfg.top_k])
        out = moe_ref(h, logits, m.w13.double(), m.w2.double(), cfg.top_k, renormalize=cfg.norm_topk_prob)
        g, u = (h @ m.shared_gate_up.double().T).chunk(2, -1)
        out = out + torch.sigmoid(h @ m.shared_expert_gate.double().T) * ((F.silu(g) * u) @ m.shared_down.double().T)
        x = x + out
    return _rms(x, model.norm.weight, eps) @ model.lm_head.double().T, torch.stack(gaps)


def _attention(a, cfg, h, pos):
    t, d, eps = h.shape[0], cfg.head_size, cfg.rms_norm_eps
    q, k, v = (h @ a.qkv_proj.double().T).split([a.q_width, cfg.num_kv_heads * d, cfg.num_kv_heads * d], -1)
    q, gate = q.view(t, cfg.num_heads, 2 * d).chunk(2, -1)
    q = _rope(_rms(q, a.q_norm.weight, eps), pos, cfg.rotary_dim, cfg.rope_theta)
    k = _rope(_rms(k.view(t, cfg.num_kv_heads, d), a.k_norm.weight, eps), pos, cfg.rotary_dim, cfg.rope_theta)
    group = cfg.num_heads // cfg.num_kv_heads
    k = k.repeat_interleave(group, 1)
    v = v.view(t, cfg.num_kv_heads, d).repeat_interleave(group, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=True).transpose(0, 1)
    return (o * torch.sigmoid(gate)).reshape(t, -1) @ a.o_proj.double().T


def _gated_deltanet(m, h, eps):
    """The whole sequence at once: zero-padded causal convolution, then the reference recurrence."""
    t, kernel = h.shape[0], m.kernel_size
    mixed, z = (h @ m.in_proj_qkvz.double().T).split([m.conv_dim, m.value_dim], -1)
    b, a = (h @ m.in_proj_ba.double().T).chunk(2, -1)
    conv = F.conv1d(F.pad(mixed.T, (kernel - 1, 0))[None], m.conv1d.double()[:, None, :], groups=m.conv_dim)[0].T
    q, k, v = F.silu(conv).split([m.key_dim, m.key_dim, m.value_dim], -1)
    g = -m.A_log.double().exp() * F.softplus(a + m.dt_bias.double())
    o, _ = kernels.get("gated_delta_rule", "reference")(
        q.view(1, t, m.num_k_heads, m.head_k), k.view(1, t, m.num_k_heads, m.head_k),
        v.view(1, t, m.num_v_heads, m.head_v), g[None], torch.sigmoid(b)[None], use_qk_l2norm_in_kernel=True)
    o = _rms(o[0], m.norm.weight, eps) * F.silu(z.view(t, m.num_v_heads, m.head_v))
    return o.reshape(t, -1) @ m.out_proj.double().T
