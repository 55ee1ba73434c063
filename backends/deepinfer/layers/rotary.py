"""Rotary position embedding with the scalings checkpoints use: linear, llama3, yarn (DeepSeek's
included), dynamic (NTK) and longrope. Frequencies follow transformers' formulas exactly, so
cos/sin match the reference bit for bit; they are tabulated once for every position up to the
model length.

transformers recomputes dynamic and longrope frequencies on each forward from the longest
position in it, so the keys of one sequence can be rotated with different frequencies as it
grows. A paged, prefix-cached engine cannot: its cached keys must not depend on who computed
them. So here both are fixed by the engine's context (`max_positions`), as vLLM fixes dynamic
NTK: dynamic scales its base for a context of `max_positions` (none within the checkpoint's
`max_position_embeddings`), longrope takes its long factors when the context exceeds
`original_max_position_embeddings` and its short ones otherwise. Within those defaults the
logits are transformers'; `ModelRunner` keeps the default context there."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotates the last dimension of q and k by position.

    `interleaved`: pairs are (x0, x1), (x2, x3)... (DeepSeek's layout) instead of the two
    halves (x_i, x_{i+d/2}). Either way the output is in halves layout; since q and k get the
    same treatment their dot products are those of the interleaved rotation."""

    def __init__(
        self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0, interleaved: bool = False
    ) -> None:
        super().__init__()
        self.interleaved = interleaved
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :].float()
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(-2)  # [T, 1, d/2]: broadcast over heads
        sin = self.sin[positions].unsqueeze(-2)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        # Straight into the two halves of the output: no temporaries and no concatenation.
        # addcmul may fuse its multiply and add, so a value can differ from transformers' in
        # its last bit.
        out = x.new_empty(x.shape)
        first, second = out.chunk(2, dim=-1)
        torch.mul(x1, cos, out=first).addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=second).addcmul_(x1, sin)
        return out


def rope_from_config(
    params: dict[str, Any], dim: int, max_positions: int, interleaved: bool = False
) -> RotaryEmbedding:
    """`params`: `HFConfig.rope_parameters`; `dim`: the rotated width of a head."""
    inv_freq, scaling = rope_frequencies(params, dim, max_positions)
    return RotaryEmbedding(inv_freq, max_positions, scaling, interleaved)


def rope_frequencies(params: dict[str, Any], dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, params), 1.0
    if kind == "yarn":
        return _yarn(base, dim, params)
    if kind == "dynamic":
        factor, trained = float(params["factor"]), int(params["original_max_position_embeddings"])
        context = max(max_positions, trained)
        base *= (factor * context / trained - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base**exponents), 1.0
    if kind == "longrope":
        return _longrope(base, exponents, params, max_positions)
    raise ValueError(
        f"unsupported rope type {kind!r} (supported: default, linear, llama3, yarn, dynamic, longrope)"
    )


def _longrope(
    base: float, exponents: torch.Tensor, p: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    trained = int(p["original_max_position_embeddings"])
    factor = float(p["factor"])
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(trained))
    ext = torch.tensor(
        p["long_factor"] if max_positions > trained else p["short_factor"], dtype=torch.float32
    )
    return 1.0 / (ext * base**exponents), float(attention_factor)


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, dim: int, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = float(p["factor"])
    old_len = float(p["original_max_position_embeddings"])
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)
