"""Qwen3-MoE: Qwen3's attention (a per-head RMSNorm on q and k) with a routed-experts block
(`layers/moe.Qwen3MoE`) in every `decoder_sparse_step`-th layer but those in `mlp_only_layers`,
which keep a dense MLP of `intermediate_size`."""

from __future__ import annotations

from typing import Any

from torch import nn

from backends.deepinfer.hf_config import HFConfig
from backends.deepinfer.layers.mlp import GatedMLP
from backends.deepinfer.layers.moe import Qwen3MoE, expert_weight_target
from backends.deepinfer.models.base import CausalLM, DecoderLayer
from backends.deepinfer.models.llama import LlamaAttention, llama_rope


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, config: HFConfig, max_positions: int) -> None:
        bias = bool(config.get("attention_bias", False))
        dense_only = set(config.get("mlp_only_layers") or ())
        step = int(config.get("decoder_sparse_step", 1))
        rope = llama_rope(config, max_positions)
        layers = []
        for index in range(config.num_hidden_layers):
            mlp: nn.Module
            if index not in dense_only and config.num_experts > 0 and (index + 1) % step == 0:
                mlp = Qwen3MoE(config)
            else:
                mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"))
            attention = LlamaAttention(config, rope, bias, bias, qk_norm=True)
            layers.append(DecoderLayer(attention, mlp, config.hidden_size, config.rms_norm_eps))
        super().__init__(config, layers)

    def weight_target(self, name: str) -> tuple[str, Any] | None:
        return expert_weight_target(name) or super().weight_target(name)
