"""How long an engine step takes: the one model the router predicts TTFT with and the mocker
simulates steps with, so a replay and a live router reason about the same engine.

The default is the polynomial NVIDIA Dynamo's mocker uses: a step's prefill part costs a
quadratic in the new (uncached) tokens it computes, its decode part a quadratic in the
fraction of KV blocks in use, floored at 1 ms; a step with both costs their sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _poly(coeffs: tuple[float, ...], x: float) -> float:
    result = 0.0
    for c in reversed(coeffs):
        result = result * x + c
    return result


@dataclass(frozen=True, slots=True)
class StepTime:
    # x = new tokens computed in the step, summed over the batch; ascending powers
    prefill_ms: tuple[float, ...] = (16.50142, 1.518344e-02, 4.209989e-07)
    # x = fraction of the worker's KV blocks in use
    decode_ms: tuple[float, ...] = (5.74, 54.01, -25.74)
    min_decode_ms: float = 1.0

    def __post_init__(self) -> None:
        if not self.prefill_ms or not self.decode_ms:
            raise ValueError("a step time model needs at least one prefill and one decode coefficient")

    def prefill(self, num_tokens: int) -> float:
        return max(0.0, _poly(self.prefill_ms, num_tokens)) if num_tokens else 0.0

    def decode(self, kv_usage: float) -> float:
        return max(self.min_decode_ms, _poly(self.decode_ms, kv_usage))

    def step_ms(self, prefill_tokens: int, decoding: bool, kv_usage: float) -> float:
        """A step computing `prefill_tokens` prompt tokens and, if `decoding`, one token for
        each decoding sequence."""
        return self.prefill(prefill_tokens) + (self.decode(kv_usage) if decoding else 0.0)

    def prefill_wait_ms(self, num_tokens: int, step_tokens: int, decoding: bool, kv_usage: float) -> float:
        """Time to compute `num_tokens` prompt tokens in steps of at most `step_tokens` (the
        engine's token budget), beside decodes if `decoding`: what a prompt behind that much
        queued prefill waits for its first token."""
        if num_tokens <= 0:
            return 0.0
        steps = math.ceil(num_tokens / step_tokens)
        full, last = divmod(num_tokens, step_tokens)
        ms = full * self.prefill(step_tokens) + self.prefill(last)
        return ms + (steps * self.decode(kv_usage) if decoding else 0.0)
