"""A Qwen3-MoE / Qwen3.6-shaped decoder. Each layer mixes tokens with either GQA attention (per-head
q/k RMSNorm, partial rotary embedding, a sigmoid output gate) or a Gated DeltaNet layer, as the
model config's ``layer_types`` say (Qwen3.6: three Gated DeltaNet layers, then one attention layer),
then runs the sparse MoE with its shared expert.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.kernel_choice import Kernels
from engine.layers.attention import PagedAttention
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.layers.layernorm import RMSNorm
from engine.layers.moe import SparseMoeBlock
from engine.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from engine.model_config import LINEAR_ATTENTION, ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_size
        self.num_heads, self.num_kv_heads, self.head_size = cfg.num_heads, cfg.num_kv_heads, d
        self.gated = cfg.attn_output_gate
        self.q_width = cfg.num_heads * d * (2 if self.gated else 1)
        self.qkv_proj = nn.Parameter(torch.empty(self.q_width + 2 * cfg.num_kv_heads * d, h))
        self.o_proj = nn.Parameter(torch.empty(h, cfg.num_heads * d))
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, d, kernels)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t, d = x.shape[0], self.head_size
        q, k, v = F.linear(x, self.qkv_proj).split(
            [self.q_width, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        if self.gated:  # per head: [query | gate], as Qwen3-Next lays out q_proj
            q, gate = q.view(t, self.num_heads, 2 * d).chunk(2, dim=-1)
        else:
            q = q.view(t, self.num_heads, d)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, d))
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = self.attn(q, k, v.reshape(t, self.num_kv_heads, d), meta)
        if self.gated:
            o = o * torch.sigmoid(gate)
        return F.linear(o.reshape(t, -1), self.o_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels, kind: str):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(cfg, kernels)
        else:
            self.self_attn = Attention(cfg, kernels)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size,
                                  cfg.shared_expert_intermediate_size, cfg.norm_topk_prob, kernels)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if hasattr(self, "linear_attn"):
            x = x + self.linear_attn(self.input_norm(x), meta)
        else:
            x = x + self.self_attn(rope, self.input_norm(x), meta)
        return x + self.mlp(self.post_attention_norm(x))


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, kernels, kind) for kind in cfg.layer_kinds)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states of every token."""
        x = F.embedding(input_ids, self.embed_tokens)
        rope = self.rotary.angles(positions)
        for layer in self.layers:
            x = layer(rope, x, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)

    @torch.no_grad()
    def init_weights(self, seed: int, lm_head_scale: float = 8.0) -> None:
        """Random weights from ``seed``: unit-variance activations through every projection, norms
        at one, and a sharpened LM head so that greedy choices are rarely near-ties; Gated DeltaNet
        decays spread from fast to slow (``GatedDeltaNet.init_gates``)."""
        gen = torch.Generator(device=self.embed_tokens.device)
        gen.manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = p.shape[-1] ** -0.5
            if name == "embed_tokens":
                std = 1.0
            elif name == "lm_head":
                std *= lm_head_scale
            p.normal_(0.0, std, generator=gen)
        for m in self.modules():
            if isinstance(m, GatedDeltaNet):
                m.init_gates(gen)
