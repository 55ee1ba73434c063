"""How long a simulated engine step takes: `router.step_time.StepTime`, the model the router
predicts with, so simulated and predicted steps are one model.

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

from router.step_time import StepTime


class _TimingFile(msgspec.Struct, forbid_unknown_fields=True):
    prefill_ms: list[float]
    decode_ms: list[float]
    min_decode_ms: float = 1.0


@dataclass(frozen=True, slots=True)
class TimingModel(StepTime):
    """The router's step time model (`router.step_time`), plus what only a simulated engine
    needs: the pipeline of layer-wise KV loads, and curves read from a file."""

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
