"""Qwen2: Llama's shape with biases on the q/k/v projections (and none on o_proj)."""

from __future__ import annotations

from backends.deepinfer.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
