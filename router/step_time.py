"""How long an engine step takes: the one model the router predicts TTFT with and the mocker
simulates steps with, so a replay and a live router reason about the same engine.

The default is the polynomial NVIDIA Dynamo's mocker uses: a step's prefill part costs a
quadratic in the new (uncached) tokens it computes, its decode part a quadratic in the
fraction of KV blocks in use, floored at 1 ms; a step with both costs their sum.

A worker whose engine is real fits the same quadratics to the steps it ran (`StepTimeFit`)
and reports them in its load report (`LoadReport.step_time`): the router then predicts with
each worker's own curve, and a simulated worker reports the curve it simulates.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from orchestrator.runtime.protocol import StepCurves


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

    @classmethod
    def from_curves(cls, curves: StepCurves) -> StepTime:
        return cls(tuple(curves.prefill_ms), tuple(curves.decode_ms), curves.min_decode_ms)

    def curves(self, samples: int = 0) -> StepCurves:
        return StepCurves(list(self.prefill_ms), list(self.decode_ms), self.min_decode_ms, samples)

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


# Prefill tokens are scaled by this before fitting, so that the quadratic's columns are of
# one order of magnitude and the solve is well conditioned.
_TOKEN_SCALE = 1000.0


class StepTimeFit:
    """Fits `StepTime`'s two quadratics to steps an engine ran: (prefill tokens, whether it
    decoded, KV use) -> milliseconds, by least squares on relative errors over the last
    `window` steps. A curve with fewer than `min_steps` steps of its kind in the window (no
    prefill yet) stays at `prior`'s, and the other is fitted to what it leaves. Refits every
    `refit_every` steps; `curve()` is the latest fit."""

    def __init__(
        self, prior: StepTime | None = None, window: int = 512, refit_every: int = 32, min_steps: int = 8
    ) -> None:
        self.prior = prior or StepTime()
        if len(self.prior.prefill_ms) != 3 or len(self.prior.decode_ms) != 3:
            raise ValueError("the fit's prior must be two quadratics")
        self.refit_every = refit_every
        self.min_steps = min_steps
        self.samples = 0  # steps observed, all told
        self._rows: deque[tuple[float, ...]] = deque(maxlen=window)
        self._ms: deque[float] = deque(maxlen=window)
        self._curve = self.prior

    def observe(self, prefill_tokens: int, decoding: bool, kv_usage: float, ms: float) -> None:
        x = prefill_tokens / _TOKEN_SCALE
        p = 1.0 if prefill_tokens else 0.0
        d = 1.0 if decoding else 0.0
        self._rows.append((p, p * x, p * x * x, d, d * kv_usage, d * kv_usage * kv_usage))
        self._ms.append(ms)
        self.samples += 1
        if self.samples % self.refit_every == 0:
            self._curve = self._fit()

    def curve(self) -> StepTime:
        return self._curve

    def curves(self) -> StepCurves | None:
        """The latest fit as a load report carries it; None before the first."""
        return self._curve.curves(self.samples) if self.samples >= self.refit_every else None

    def _fit(self) -> StepTime:
        rows = np.asarray(self._rows)
        y = np.asarray(self._ms)
        scale = np.array([1.0, _TOKEN_SCALE, _TOKEN_SCALE**2, 1.0, 1.0, 1.0])
        coefficients = np.array([*self.prior.prefill_ms, *self.prior.decode_ms]) * scale
        counts = rows[:, [0, 3]].sum(axis=0)  # prefill steps, decode steps
        free = np.repeat(counts >= self.min_steps, 3)
        if not free.any():
            return self.prior
        # Each step's relative error counts alike (weights 1/ms): a long prefill's noise
        # must not outweigh every short step, whose time is most of what TTFTs add up.
        weights = 1.0 / np.maximum(y, 1e-3)
        target = (y - rows[:, ~free] @ coefficients[~free]) * weights
        solved, *_ = np.linalg.lstsq(rows[:, free] * weights[:, None], target, rcond=None)
        coefficients[free] = solved
        fitted = (coefficients / scale).tolist()
        return StepTime(tuple(fitted[:3]), tuple(fitted[3:]), self.prior.min_decode_ms)
