"""Mixture-of-experts feed-forward blocks: routed experts in fused weights, and two routers.

- DeepSeekMoE (DeepSeek-V3): shared experts plus routed experts chosen by `noaux_tc` grouped
  top-k. Sigmoid scores per expert; the choice adds `e_score_correction_bias` (the
  auxiliary-loss-free balancing term), keeps the `topk_group` groups whose two best experts
  score highest, then the top `num_experts_per_tok` experts within them. The mixing weights
  are the unbiased scores of the chosen experts, renormalized (`norm_topk_prob`) and
  multiplied by `routed_scaling_factor`.
- Qwen3-MoE: routed experts only, chosen by the top `num_experts_per_tok` of a softmax over
  all experts, whose probabilities are the mixing weights (renormalized over the chosen ones
  when `norm_topk_prob`).

Checkpoints store each expert's projections by name (`experts.{e}.{gate,up,down}_proj`);
`expert_weight_target` maps them onto the fused tensors.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backends.deepinfer.hf_config import HFConfig
from backends.deepinfer.layers.linear import default_weight_loader, new_parameter
from backends.deepinfer.layers.mlp import GatedMLP


class GroupedTopKRouter(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        if (
            config.get("topk_method", "noaux_tc") != "noaux_tc"
            or config.get("scoring_func", "sigmoid") != "sigmoid"
        ):
            raise ValueError(
                "DeepInfer implements DeepSeek-V3 routing only (topk_method noaux_tc, sigmoid scores)"
            )
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = config.get("n_group", 1)
        self.topk_group = config.get("topk_group", 1)
        self.norm_topk_prob = bool(config.get("norm_topk_prob", True))
        self.routed_scaling_factor = float(config.get("routed_scaling_factor", 1.0))
        self.weight = new_parameter(self.num_experts, config.hidden_size)
        self.e_score_correction_bias = new_parameter(self.num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, D]` -> (weights `[T, k]` float32, expert ids `[T, k]`)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts


class SoftmaxTopKRouter(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(config.get("norm_topk_prob", False))
        self.weight = new_parameter(config.num_experts, config.hidden_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, D]` -> (weights `[T, k]` float32, expert ids `[T, k]`)."""
        probs = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts


class FusedExperts(nn.Module):
    """All routed experts' weights in two stacked tensors; the checkpoint's per-expert
    `experts.{e}.{gate,up,down}_proj` tensors load with shard id `(e, "gate"|"up"|"down")`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        gate_up = [(e, which) for e in range(num_experts) for which in ("gate", "up")]
        self.w13 = new_parameter(
            num_experts, 2 * intermediate_size, hidden_size, loader=self.weight_loader, shard_ids=gate_up
        )
        down = [(e, "down") for e in range(num_experts)]
        self.w2 = new_parameter(
            num_experts, hidden_size, intermediate_size, loader=self.weight_loader, shard_ids=down
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        expert, which = shard_id
        rows = {"gate": (0, self.intermediate_size), "up": (self.intermediate_size, self.intermediate_size)}
        target = param.data[expert]
        if which in rows:
            target = target.narrow(0, *rows[which])
        default_weight_loader(target, loaded)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        # Loop over the experts actually hit, in id order (a fixed order keeps results reproducible).
        for expert in experts.unique().tolist():
            token, slot = (experts == expert).nonzero(as_tuple=True)
            gate, up = F.linear(x[token], self.w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[expert])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
        return out


class DeepseekMoE(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.gate = GroupedTopKRouter(config)
        self.experts = FusedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        shared = config.moe_intermediate_size * config.get("n_shared_experts", 0)
        self.shared_experts = GatedMLP(config.hidden_size, shared, config.hidden_act) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        out = self.experts(x, weights, experts)
        return out + self.shared_experts(x) if self.shared_experts is not None else out


class Qwen3MoE(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.gate = SoftmaxTopKRouter(config)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        return self.experts(x, weights, experts)


_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def expert_weight_target(name: str) -> tuple[str, Any] | None:
    """The fused parameter and shard id of a per-expert checkpoint tensor; None for any other."""
    expert = _EXPERT.match(name)
    if expert is None:
        return None
    fused = "w2" if expert["proj"] == "down" else "w13"
    return f"{expert['prefix']}.{fused}", (int(expert["expert"]), expert["proj"])
