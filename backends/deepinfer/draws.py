"""Pseudo-random draws that are a function of (seed, position) only. No torch.

A seeded request's draw for output position i depends on nothing else: not on what else is
batched with it, not on how many draws came before on this worker. So a request that
migrates to another worker after i tokens (carrying them in `generated_token_ids`) draws
there exactly what it would have drawn here. DeepInfer's sampler and the mocker's token
generator both draw from it."""

from __future__ import annotations

_M64 = (1 << 64) - 1


def position_bits(seed: int, position: int) -> int:
    """64 pseudo-random bits for (seed, position): splitmix64's mixer over seed + position * golden."""
    x = (seed + position * 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) & _M64
    return x ^ (x >> 29)


def position_uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) with 24 bits, so it is exact in float32 and never rounds up to 1."""
    return (position_bits(seed, position) >> 40) / float(1 << 24)
