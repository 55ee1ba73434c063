"""Disaggregation: whether a request's prompt is computed on a prefill worker and handed over
to a decode worker, or the whole request runs on one worker. A pure policy: no I/O, no clock,
so the frontend and an offline replay decide with the same code from the same inputs.

What disaggregation buys is decode steps that no prefill stalls: a decode worker's batch waits
for every prefill scheduled beside it. What it costs is a second request and a KV transfer
between the first token and the second (the handover), and, when the prefill pool is behind,
a later first token. So the adaptive rule disaggregates when

1. the predicted TTFT on the prefill pool is no worse than on the whole-request pool. A path's
   TTFT is predicted as (prefill tokens queued on its best worker + the prompt tokens that
   worker must compute) / prefill throughput; every pool runs the same engine, so the
   throughput cancels and the policy compares token counts. This is Dynamo's "skip the prefill
   pool when it is busy" as a prediction instead of a fixed threshold: a busy prefill pool is
   still used while the whole-request workers are busier; and
2. the prompt's uncached part on the best whole-request worker is at least
   `min_uncached_tokens`. NVIDIA Dynamo keeps prompts under 2,048 uncached tokens local, on
   the argument that a short prefill costs a decode batch less than a handover costs the
   request. Measured, it does not: a prefill step of any length costs a step's fixed overhead
   (16.5 ms in Dynamo's own timing model against about 6 ms for a decode step), which every
   decode on that worker waits out. In `benchmarks/disagg_replay.py` (4 mockers, 2 + 2 when
   disaggregated) a 2,048 threshold gave inter-token p99 of 31 ms on short prompts and on a
   mixed load, against 6 and 8 ms with none, and 0.94 of the goodput of a threshold of 0 on
   the mixed load. So the default is 0; the setting stays for engines whose short prefills are
   cheap (`--disagg-min-uncached-tokens`).

`never` and `always` exist to compare against (`always` still needs a prefill worker and a
decode worker to be available)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

from router.protocols import WorkerLoad

Mode = Literal["never", "always", "adaptive"]
MODES: tuple[Mode, ...] = ("never", "always", "adaptive")
DEFAULT_MIN_UNCACHED_TOKENS = 0


@dataclass(frozen=True, slots=True)
class Candidate:
    """A pool's best worker for one prompt: the prompt tokens it would compute and the prefill
    tokens queued on it ahead of them (its last report plus what routers sent it since)."""

    uncached_tokens: int
    queued_tokens: int

    @property
    def predicted_tokens(self) -> int:
        """Prefill tokens computed before this prompt's first token: its TTFT, in tokens."""
        return self.queued_tokens + self.uncached_tokens


@dataclass(frozen=True, slots=True)
class Choice:
    disaggregate: bool
    reason: str  # why, for the debug log: never, always, short, prefill_busy, pays, no_prefill, no_decode


def best_candidate(
    num_tokens: int,
    block_size: int,
    hits: Mapping[str, int],
    loads: Mapping[str, WorkerLoad],
    skip: Collection[str] = (),
) -> Candidate | None:
    """The worker of `loads` (less `skip`) with the fewest predicted prefill tokens, from each
    worker's cached prefix blocks (`hits`, absent: none); None when no worker is left."""
    best: Candidate | None = None
    for worker_id, load in loads.items():
        if worker_id in skip:
            continue
        uncached = max(num_tokens - hits.get(worker_id, 0) * block_size, 0)
        candidate = Candidate(uncached, load.prefill_tokens)
        if best is None or candidate.predicted_tokens < best.predicted_tokens:
            best = candidate
    return best


@dataclass(frozen=True, slots=True)
class DisaggPolicy:
    mode: Mode = "adaptive"
    min_uncached_tokens: int = DEFAULT_MIN_UNCACHED_TOKENS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown disaggregation mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.min_uncached_tokens < 0:
            raise ValueError("min_uncached_tokens must be >= 0")

    def decide(self, whole: Candidate | None, prefill: Candidate | None, decode_ready: bool) -> Choice:
        """`whole`: the best worker to run the request whole (aggregated or decode role);
        `prefill`: the best prefill worker; `decode_ready`: a decode worker can take the
        handover. None: no such worker is available."""
        if self.mode == "never":
            return Choice(False, "never")
        if prefill is None:
            return Choice(False, "no_prefill")
        if not decode_ready:
            return Choice(False, "no_decode")
        if self.mode == "always" or whole is None:
            return Choice(True, "always" if self.mode == "always" else "pays")
        if whole.uncached_tokens < self.min_uncached_tokens:
            return Choice(False, "short")
        if prefill.predicted_tokens > whole.predicted_tokens:
            return Choice(False, "prefill_busy")
        return Choice(True, "pays")
