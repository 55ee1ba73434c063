"""Token embedding and the language-model head (its own weight, or the embedding's when tied)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.deepinfer.layers.linear import new_parameter


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = new_parameter(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """`tie_to` shares the embedding's parameter, so a tied checkpoint loads it once."""

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.weight = tie_to.weight if tie_to is not None else new_parameter(vocab_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)
