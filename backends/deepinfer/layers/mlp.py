"""The gated feed-forward block: down(silu(gate(x)) * up(x)), gate and up fused."""

from __future__ import annotations

import torch
from torch import nn

from backends.deepinfer.layers.activation import activation
from backends.deepinfer.layers.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.act_fn = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
