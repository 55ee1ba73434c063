"""How long a simulated engine step takes.

The default is the polynomial NVIDIA Dynamo's mocker uses, so simulated figures compare
with Dynamo's: a step's prefill part costs a quadratic in the new (uncached) tokens it
computes, its decode part a quadratic in the fraction of KV blocks in use, floored at 1 ms.
A step with both costs their sum, as Dynamo's mocker does (its step time is the decode
time plus the prefill time of the requests it prefills); the chunk that finishes a prompt
samples its first token inside the prefill and adds no decode time.

Other curves load from a JSON file: {"prefill_ms": [c0, c1, c2, ...], "decode_ms": [...],
"min_decode_ms": 1.0}, coefficients in ascending powers (ms = c0 + c1*x + c2*x^2 + ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec


def _poly(coeffs: tuple[float, ...], x: float) -> float:
    result = 0.0
    for c in reversed(coeffs):
        result = result * x + c
    return result


class _TimingFile(msgspec.Struct, forbid_unknown_fields=True):
    prefill_ms: list[float]
    decode_ms: list[float]
    min_decode_ms: float = 1.0


@dataclass(frozen=True, slots=True)
class TimingModel:
    # x = new tokens computed in the step, summed over the batch
    prefill_ms: tuple[float, ...] = (16.50142, 1.518344e-02, 4.209989e-07)
    # x = fraction of the worker's KV blocks in use
    decode_ms: tuple[float, ...] = (5.74, 54.01, -25.74)
    min_decode_ms: float = 1.0

    def __post_init__(self) -> None:
        if not self.prefill_ms or not self.decode_ms:
            raise ValueError("a timing model needs at least one prefill and one decode coefficient")

    def prefill(self, num_tokens: int) -> float:
        return max(0.0, _poly(self.prefill_ms, num_tokens)) if num_tokens else 0.0

    def decode(self, kv_usage: float) -> float:
        return max(self.min_decode_ms, _poly(self.decode_ms, kv_usage))

    def step_ms(self, prefill_tokens: int, decoding: bool, kv_usage: float) -> float:
        """A step computing `prefill_tokens` prompt tokens and, if `decoding`, one token for
        each decoding sequence."""
        return self.prefill(prefill_tokens) + (self.decode(kv_usage) if decoding else 0.0)

    @staticmethod
    def with_loads(compute_ms: float, load_ms: float, num_layers: int) -> float:
        """A step of `compute_ms` whose onboarded KV (`load_ms` of copies) arrives a layer at a
        time, as DeepInfer's does: layer i computes once its own blocks are in and layer i - 1
        is done, and the copies run one after another. A two-stage pipeline over the layers:
        the slower stage's whole time plus one layer of the other."""
        if not load_ms:
            return compute_ms
        return max(load_ms + compute_ms / num_layers, compute_ms + load_ms / num_layers)

    @classmethod
    def from_json(cls, path: str | Path) -> TimingModel:
        try:
            spec = msgspec.json.decode(Path(path).read_bytes(), type=_TimingFile)
        except (OSError, msgspec.DecodeError) as exc:
            raise ValueError(f"cannot read timing model {path}: {exc}") from exc
        return cls(tuple(spec.prefill_ms), tuple(spec.decode_ms), spec.min_decode_ms)
