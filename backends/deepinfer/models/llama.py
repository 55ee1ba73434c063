"""Llama / Mistral: grouped-query attention with RoPE (optionally scaled), gated silu MLP."""

from __future__ import annotations

import torch
from torch import nn

from backends.deepinfer.forward_batch import ForwardBatch
from backends.deepinfer.hf_config import HFConfig
from backends.deepinfer.layers.attention import Attention
from backends.deepinfer.layers.linear import Linear, MergedLinear
from backends.deepinfer.layers.mlp import GatedMLP
from backends.deepinfer.layers.norm import RMSNorm
from backends.deepinfer.layers.rotary import RotaryEmbedding, rope_from_config
from backends.deepinfer.models.base import CausalLM, DecoderLayer


def llama_rope(config: HFConfig, max_positions: int) -> RotaryEmbedding:
    """The rotations of every layer: one table per model, not one per layer (at a 128k context
    and 128-wide heads each copy is 67 MB, memory the KV cache could have had)."""
    return rope_from_config(config.rope_parameters, config.head_dim, max_positions)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: HFConfig,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool = False,
    ) -> None:
        """`rotary_emb`: the model's one table of rotations (`llama_rope`), shared by its layers."""
        super().__init__()
        heads, kv_heads, head_dim = (
            config.num_attention_heads,
            config.get("num_key_value_heads", 0),
            config.head_dim,
        )
        kv_heads = kv_heads or heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim},
            qkv_bias,
        )
        self.o_proj = Linear(heads * head_dim, config.hidden_size, o_bias)
        # Qwen3: one RMSNorm over each head's q and k (weights of size head_dim), before RoPE.
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(heads, kv_heads, head_dim, head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v.view(tokens, self.num_kv_heads, self.head_dim), batch)
        return self.o_proj(out.view(tokens, -1))


class LlamaForCausalLM(CausalLM):
    qkv_bias: bool | None = None  # None: follow config.attention_bias
    qk_norm = False

    def __init__(self, config: HFConfig, max_positions: int) -> None:
        if config.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        o_bias = bool(config.get("attention_bias", False))
        qkv_bias = o_bias if self.qkv_bias is None else self.qkv_bias
        rope = llama_rope(config, max_positions)
        layers = [
            DecoderLayer(
                LlamaAttention(config, rope, qkv_bias, o_bias, self.qk_norm),
                GatedMLP(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu")),
                config.hidden_size,
                config.rms_norm_eps,
            )
            for _ in range(config.num_hidden_layers)
        ]
        super().__init__(config, layers)
