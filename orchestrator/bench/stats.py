"""Figures from request records, with the field's conventions:

- TTFT: request sent to its first output chunk.
- TPOT: per request, (e2e - TTFT) / (output tokens - 1) (vLLM's definition; aiperf calls the
  same figure "inter token latency"); percentiles are over requests.
- ITL: every gap between consecutive output chunks of every request, pooled (vLLM's ITL);
  a chunk holding several tokens is one gap.
- E2E: request sent to its last byte.
- Percentiles are linearly interpolated (numpy's default, as vLLM and aiperf compute them).
- Throughput: completed requests, input tokens and output tokens per second of the run
  (first send to last finish).
- Goodput (DistServe): completed requests per second that met every SLO target given;
  the good fraction is those over every request sent.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from orchestrator.bench.targets import RequestRecord

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True, slots=True)
class Slo:
    """Targets in milliseconds; None is no target."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`ttft=500,tpot=50,e2e=10000` (milliseconds; any subset)."""
        targets: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep or name not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"{part!r}: expected ttft=MS, tpot=MS or e2e=MS")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"{part!r}: {value!r} is not a number of milliseconds") from None
            if not (math.isfinite(ms) and ms > 0):
                raise ValueError(f"{part!r}: a target must be a positive number of milliseconds")
            targets[f"{name}_ms"] = ms
        if not targets:
            raise ValueError("an SLO names at least one of ttft, tpot, e2e")
        return cls(**targets)

    def met(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        tpot = record.tpot_s
        return (
            (self.ttft_ms is None or record.ttft_s * 1e3 <= self.ttft_ms)
            and (self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms)
            and (self.e2e_ms is None or record.e2e_s * 1e3 <= self.e2e_ms)
        )

    def __str__(self) -> str:
        parts = [(n, getattr(self, f"{n}_ms")) for n in ("ttft", "tpot", "e2e")]
        return ",".join(f"{n}={v:g}" for n, v in parts if v is not None)


def latencies_ms(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    done = [r for r in records if r.ok]
    return {
        "ttft": [r.ttft_s * 1e3 for r in done],
        "tpot": [t * 1e3 for r in done if (t := r.tpot_s) is not None],
        "itl": [gap * 1e3 for r in done for gap in r.itl_s],
        "e2e": [r.e2e_s * 1e3 for r in done],
    }


Figures = dict[str, float | int | None]


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo | None) -> Figures:
    """A run's figures; a latency with no sample (every request failed) is None."""
    done = [r for r in records if r.ok]
    figures: Figures = {"requests": len(records), "completed": len(done)}
    figures["failed"] = len(records) - len(done)
    for name, values in latencies_ms(records).items():
        figures[f"{name}_mean_ms"] = round(float(np.mean(values)), 3) if values else None
        for q in PERCENTILES:
            figures[f"{name}_p{q}_ms"] = round(float(np.percentile(values, q)), 3) if values else None
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    input_tokens = sum(r.input_tokens for r in done)
    figures["duration_s"] = round(duration_s, 3)
    figures["request_throughput"] = round(len(done) * per_s, 3)
    figures["input_token_throughput"] = round(input_tokens * per_s, 1)
    figures["output_token_throughput"] = round(sum(r.output_tokens for r in done) * per_s, 1)
    figures["input_tokens"] = input_tokens
    figures["output_tokens"] = sum(r.output_tokens for r in done)
    # The hit rate is over the requests whose server said how much it had cached.
    reported = [r for r in done if r.cached_tokens is not None]
    cached, asked = sum(r.cached_tokens or 0 for r in reported), sum(r.input_tokens for r in reported)
    figures["cached_tokens"] = cached
    figures["cache_hit_rate"] = round(cached / asked, 4) if asked else 0.0
    if slo is not None:
        good = sum(slo.met(r) for r in records)
        figures["goodput"] = round(good * per_s, 3)
        figures["good_fraction"] = round(good / len(records), 4) if records else 0.0
    return figures


def errors_by_type(records: Sequence[RequestRecord]) -> dict[str, int]:
    return dict(Counter(r.error for r in records if r.error is not None))


def median_of(runs: Sequence[Figures]) -> tuple[Figures, dict[str, list[float]]]:
    """Per figure, the median over repeats and the [min, max] range (over the repeats that
    have the figure)."""
    medians: Figures = {}
    ranges: dict[str, list[float]] = {}
    for key in runs[0]:
        present = [v for run in runs if (v := run.get(key)) is not None]
        values = [float(v) for v in present]
        median = round(float(np.median(values)), 3) if values else None
        # A count stays a count when the median is one (odd repeats, or all equal).
        integral = median is not None and all(isinstance(v, int) for v in present) and median.is_integer()
        medians[key] = int(median) if integral and median is not None else median
        if values:
            ranges[key] = [round(min(values), 3), round(max(values), 3)]
    return medians, ranges
