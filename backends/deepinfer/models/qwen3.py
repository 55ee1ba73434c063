"""Qwen3 (dense): Llama's shape with a per-head RMSNorm on q and k before RoPE. No q/k/v bias
unless `attention_bias` says so, and `head_dim` is its own config field (it need not be
hidden_size / num_attention_heads)."""

from __future__ import annotations

from backends.deepinfer.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
