"""DeepSeek-V3: MLA attention, dense MLP in the first `first_k_dense_replace` layers, DeepSeekMoE
after. The multi-token-prediction layers a checkpoint may carry (layer indices at and beyond
num_hidden_layers) are skipped at load time: they only serve speculative decoding."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from backends.deepinfer.hf_config import HFConfig
from backends.deepinfer.layers.mla import MLAttention
from backends.deepinfer.layers.mlp import GatedMLP
from backends.deepinfer.layers.moe import DeepseekMoE, expert_weight_target
from backends.deepinfer.models.base import CausalLM, DecoderLayer

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(CausalLM):
    # MLA keeps its projections separate; only the MLPs fuse gate and up.
    packed_modules_mapping = {k: v for k, v in CausalLM.packed_modules_mapping.items() if "gate_up" in v[0]}

    def __init__(self, config: HFConfig, max_positions: int) -> None:
        layers = []
        for index in range(config.num_hidden_layers):
            mlp: nn.Module
            if index < config.get("first_k_dense_replace", 0):
                mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"))
            else:
                mlp = DeepseekMoE(config)
            layers.append(
                DecoderLayer(MLAttention(config, max_positions), mlp, config.hidden_size, config.rms_norm_eps)
            )
        super().__init__(config, layers)

    def weight_target(self, name: str) -> tuple[str, Any] | None:
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= self.config.num_hidden_layers:
            return None  # an MTP layer
        return expert_weight_target(name) or super().weight_target(name)
