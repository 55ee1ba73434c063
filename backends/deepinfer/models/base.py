"""The decoder-only skeleton every architecture shares: embed, N pre-norm blocks, norm, head.

An architecture supplies the attention and feed-forward module of each layer; parameter names
follow Hugging Face's (`model.layers.{i}.self_attn...`), so checkpoint tensors map onto them by
name, apart from the fusions listed in `packed_modules_mapping`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from backends.deepinfer.forward_batch import ForwardBatch
from backends.deepinfer.hf_config import HFConfig
from backends.deepinfer.layers.embed import LMHead, VocabEmbedding
from backends.deepinfer.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: HFConfig, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(batch.positions, x, batch)
        return self.norm(x)


class CausalLM(nn.Module):
    """`forward` returns final hidden states `[T, D]`; `compute_logits` projects the rows that
    are sampled (the runner selects them first, so the vocabulary matmul runs only there)."""

    # checkpoint tensor name fragment -> (fused parameter name fragment, shard id)
    packed_modules_mapping: dict[str, tuple[str, Any]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: HFConfig, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, layers)
        tied = bool(config.get("tie_word_embeddings", False))
        self.lm_head = LMHead(
            config.vocab_size, config.hidden_size, self.model.embed_tokens if tied else None
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def weight_target(self, name: str) -> tuple[str, Any] | None:
        """Where the checkpoint tensor `name` goes: (parameter name, shard id or None), or None
        to skip it."""
        if name.endswith("rotary_emb.inv_freq"):  # a derived buffer some exports include
            return None
        if name == "lm_head.weight" and self.config.get("tie_word_embeddings", False):
            return None  # tied: the embedding is the head
        for fragment, (fused, shard) in self.packed_modules_mapping.items():
            if f".{fragment}." in name:
                return name.replace(f".{fragment}.", f".{fused}."), shard
        return name, None
