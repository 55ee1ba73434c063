"""DeepSeek-V3: MLA attention, dense MLP in the first `first_k_dense_replace` layers, DeepSeekMoE
after, and optionally its multi-token-prediction (MTP) layers for speculative decoding.

An MTP layer (checkpoint layers at and beyond num_hidden_layers) predicts the token after the
next one: at position i it joins the main model's final hidden state h_i with the embedding of
token i + 1, runs one more decoder layer over its own KV cache, and projects through its own
head. They are built only when speculative decoding asks for them (`mtp_layers`); otherwise
the loader skips their weights."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from backends.deepinfer.forward_batch import ForwardBatch
from backends.deepinfer.hf_config import HFConfig
from backends.deepinfer.layers.embed import LMHead, VocabEmbedding
from backends.deepinfer.layers.linear import Linear
from backends.deepinfer.layers.mla import MLAttention, mla_rope
from backends.deepinfer.layers.mlp import GatedMLP
from backends.deepinfer.layers.moe import DeepseekMoE, expert_weight_target
from backends.deepinfer.layers.norm import RMSNorm
from backends.deepinfer.layers.rotary import RotaryEmbedding
from backends.deepinfer.models.base import CausalLM, DecoderLayer

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
# An MTP layer's own parts; everything else under its index is its decoder block.
_MTP_PARTS = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")


def _decoder_layer(config: HFConfig, index: int, rope: RotaryEmbedding) -> DecoderLayer:
    mlp: nn.Module
    if index < config.get("first_k_dense_replace", 0):
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"))
    else:
        mlp = DeepseekMoE(config)
    return DecoderLayer(MLAttention(config, rope), mlp, config.hidden_size, config.rms_norm_eps)


class SharedHead(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = LMHead(config.vocab_size, config.hidden_size)


class MTPLayer(nn.Module):
    """One multi-token-prediction module (DeepSeek-V3 report, section 2.2), with its checkpoint's
    own embedding and head (copies of the main model's in the released weights)."""

    def __init__(self, config: HFConfig, index: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabEmbedding(config.vocab_size, hidden)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden)
        self.block = _decoder_layer(config, index, rope)
        self.shared_head = SharedHead(config)

    def forward(self, batch: ForwardBatch, previous_hidden: torch.Tensor) -> torch.Tensor:
        """`batch.input_ids` holds token i + 1 at position i; `previous_hidden` the main model's
        final hidden state at position i, one row per token."""
        embeds = self.embed_tokens(batch.input_ids)
        embeds[batch.positions == 0] = 0  # as vLLM and SGLang do: position 0 is not predicted from
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(previous_hidden)), dim=-1))
        return self.block(batch.positions, x, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden))


class DeepseekV3ForCausalLM(CausalLM):
    # MLA keeps its projections separate; only the MLPs fuse gate and up.
    packed_modules_mapping = {k: v for k, v in CausalLM.packed_modules_mapping.items() if "gate_up" in v[0]}

    def __init__(self, config: HFConfig, max_positions: int, mtp_layers: int = 0) -> None:
        available = int(config.get("num_nextn_predict_layers", 0) or 0)
        if mtp_layers > available:
            raise ValueError(
                f"{config.architecture}: {mtp_layers} MTP layers asked for, the checkpoint has {available}"
            )
        rope = mla_rope(config, max_positions)
        layers = [_decoder_layer(config, i, rope) for i in range(config.num_hidden_layers)]
        super().__init__(config, layers)
        # After the main model's modules, so the MTP layers' caches come last among cache layers.
        first = config.num_hidden_layers
        self.mtp = nn.ModuleList(MTPLayer(config, first + j, rope) for j in range(mtp_layers))

    def weight_target(self, name: str) -> tuple[str, Any] | None:
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= self.config.num_hidden_layers:
            mtp, rest = int(layer.group(1)) - self.config.num_hidden_layers, layer.group(2)
            if mtp >= len(self.mtp):
                return None  # an MTP layer that is not used
            part = "" if rest.startswith(_MTP_PARTS) else "block."
            name = f"mtp.{mtp}.{part}{rest}"
        return expert_weight_target(name) or super().weight_target(name)
