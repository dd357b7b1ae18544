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
from engine.layers.rotary_embedding import RotaryEmbedding
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
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)  # weights of the fused q/k norm + rotary kernel
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps
        self.kernels = kernels
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
        q, k = self.kernels.qk_norm_rope(q, k.view(t, self.num_kv_heads, d), self.q_norm.weight,
                                         self.k_norm.weight, *rope, self.eps)
        o = self.attn(q, k, v.view(t, self.num_kv_heads, d), meta)
        if self.gated:
            o = o * torch.sigmoid(gate)
        return F.linear(o.reshape(t, -1), self.o_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels, kind: str):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        if kind == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(cfg, kernels)
        else:
            self.self_attn = Attention(cfg, kernels)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size,
                                  cfg.shared_expert_intermediate_size, cfg.norm_topk_prob, kernels)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): the next norm adds them, fused."""
        if residual is None:
            h, residual = self.input_norm(x), x
        else:
            h, residual = self.input_norm(x, residual)
        if hasattr(self, "linear_attn"):
            h = self.linear_attn(h, meta)
        else:
            h = self.self_attn(rope, h, meta)
        h, residual = self.post_attention_norm(h, residual)
        return self.mlp(h), residual


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        self.config = cfg
        # everything an attention-only model's decode step reads is in the static buffers of
        # engine/cuda_graphs.py (ids, positions, slots, lengths, block tables), so its steps can be
        # captured as CUDA graphs; Gated DeltaNet state slots are not among them yet
        self.static_decode = not cfg.is_hybrid
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, kernels, kind) for kind in cfg.layer_kinds)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states of every token."""
        x = F.embedding(input_ids, self.embed_tokens)
        rope = self.rotary.angles(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)

    def _init_tensors(self):
        """(name, tensor) of every weight, in parameter order, except that a module with
        ``init_views`` gives its weights as those views."""
        for prefix, module in self.named_modules():
            views = getattr(module, "init_views", None)
            items = views() if views is not None else module.named_parameters(recurse=False)
            for name, tensor in items:
                yield f"{prefix}.{name}" if prefix else name, tensor

    @torch.no_grad()
    def init_weights(self, seed: int, lm_head_scale: float = 8.0) -> None:
        """Random weights from ``seed``: unit-variance activations through every projection, norms
        at one, and a sharpened LM head so that greedy choices are rarely near-ties; Gated DeltaNet
        decays spread from fast to slow (``GatedDeltaNet.init_gates``)."""
        gen = torch.Generator(device=self.embed_tokens.device)
        gen.manual_seed(seed)
        for name, p in self._init_tensors():
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
