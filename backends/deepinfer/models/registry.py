"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from typing import Protocol

from backends.deepinfer.hf_config import HFConfig
from backends.deepinfer.models.base import CausalLM
from backends.deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
from backends.deepinfer.models.llama import LlamaForCausalLM
from backends.deepinfer.models.qwen2 import Qwen2ForCausalLM
from backends.deepinfer.models.qwen3 import Qwen3ForCausalLM
from backends.deepinfer.models.qwen3_moe import Qwen3MoeForCausalLM


class ModelClass(Protocol):
    def __call__(self, config: HFConfig, max_positions: int) -> CausalLM: ...


MODELS: dict[str, ModelClass] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def model_class(config: HFConfig) -> ModelClass:
    arch = config.architecture
    if arch not in MODELS:
        raise ValueError(f"unsupported architecture {arch!r}; DeepInfer supports {sorted(MODELS)}")
    return MODELS[arch]


def build_model(config: HFConfig, max_positions: int, mtp_layers: int = 0) -> CausalLM:
    """The model for `config`, with its first `mtp_layers` multi-token-prediction layers."""
    cls = model_class(config)
    if not mtp_layers:
        return cls(config, max_positions)
    if cls is not DeepseekV3ForCausalLM:
        raise ValueError(f"{config.architecture} has no MTP layers; the mtp method needs DeepSeek-V3's")
    return DeepseekV3ForCausalLM(config, max_positions, mtp_layers)
