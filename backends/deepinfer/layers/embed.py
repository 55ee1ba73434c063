"""Token embedding and the language-model head (its own weight, or the embedding's when tied)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.deepinfer.layers.linear import can_pack, new_parameter, pack_weight, packed_linear


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
        self.tied = tie_to is not None
        self.weight = tie_to.weight if tie_to is not None else new_parameter(vocab_size, hidden_size)
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        """As `Linear.pack`; a tied head keeps the weight, which the embedding reads (the packed
        copy is worth its memory: at 32 rows SmolLM2's head multiplies 1.8x faster)."""
        if can_pack(self.weight):
            self.packed = pack_weight(self.weight)
            if not self.tied:
                self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(hidden, self.packed, None)
        return F.linear(hidden, self.weight)
