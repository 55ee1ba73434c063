"""The KV router's cost model and selection, as pure functions.

    cost(w) = overlap_weight * prefill_blocks(w) + active_blocks(w)
    prefill_blocks(w) = request_blocks - (device_hits(w) + sum over tiers t of credit_t * hits_t(w))

`prefill_blocks` is the prompt work the worker would still have to compute: blocks it holds
on the device are free, blocks in a host, disk or remote tier save the fraction `credit_t` of
a device hit (they must be onboarded, more slowly the slower the tier). A remote block counts
for every worker, which can all load it, so its credit narrows the gap between the worker
that holds a prefix on its device and the others: a high remote credit spreads requests
towards workers that must then load what they could have found on a device (the defaults
and their measurements: docs/router.md). `active_blocks` is the KV the worker is already
decoding with, a proxy for how slow its decode steps are. A larger `overlap_weight` favours
cache hits over balance.

Temperature 0 takes the cheapest worker; ties go to the least loaded, then to a seeded
random choice (so equal workers share the ties rather than the first id taking them all).
Temperature T > 0 samples p(w) ∝ exp(-(c(w) - c_min) / ((c_max - c_min) * T)).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from orchestrator.runtime.protocol import Tier
from router.protocols import WorkerLoad


@dataclass(frozen=True, slots=True)
class CostParams:
    overlap_weight: float = 1.0
    temperature: float = 0.0
    # The fraction of a device hit that a hit in each lower tier saves (docs/router.md).
    host_credit: float = 0.5
    disk_credit: float = 0.25
    remote_credit: float = 0.1
    busy_kv_fraction: float = 0.95  # a worker whose reported KV use is above this is busy
    busy_waiting_requests: int = 0  # > 0: a worker with more waiting requests is busy
    # The herding guard (`balanced`): a worker with more requests than both balance_rel times
    # and balance_abs_requests more than the least loaded candidate's is left out; 0 turns it off.
    balance_abs_requests: int = 8
    balance_rel: float = 1.5

    @property
    def tier_credits(self) -> dict[Tier, float]:
        return {"host": self.host_credit, "disk": self.disk_credit, "remote": self.remote_credit}

    def __post_init__(self) -> None:
        if self.overlap_weight < 0 or self.temperature < 0:
            raise ValueError("overlap_weight and temperature must be >= 0")
        for tier, credit in self.tier_credits.items():
            if not 0.0 <= credit <= 1.0:
                raise ValueError(f"the {tier} tier's credit must be within [0, 1], got {credit}")
        if not 0.0 < self.busy_kv_fraction <= 1.0:
            raise ValueError("busy_kv_fraction must be within (0, 1]")
        if self.balance_abs_requests < 0 or self.balance_rel < 1.0:
            raise ValueError("balance_abs_requests must be >= 0 and balance_rel >= 1")


def cached_blocks(hit_blocks: int, lower_hits: Mapping[Tier, int], params: CostParams) -> float:
    """Credited prefix hits: `hit_blocks` counts every cached prefix block, of which
    `lower_hits` sit off the device, per tier, and count that tier's credit each."""
    credits = params.tier_credits
    return hit_blocks - sum((1.0 - credits[tier]) * n for tier, n in lower_hits.items())


def costs(
    request_blocks: float,
    cached: Mapping[int, float] | Sequence[float],
    active: Sequence[int],
    params: CostParams,
) -> list[float]:
    """The cost of each candidate from its active blocks and credited hits: `cached` is
    parallel to `active`, or a mapping from candidate index to hits for the few candidates
    that have any (the per-decision path: every other candidate costs the same cold prefill
    plus its active blocks, one addition each)."""
    weight = params.overlap_weight
    cold = weight * (request_blocks if request_blocks > 0 else 0.0)
    out = [cold + a for a in active]
    if isinstance(cached, Mapping):
        hits: Iterable[tuple[int, float]] = cached.items()
    else:
        if len(cached) != len(active):
            raise ValueError("cached and active differ in length")
        hits = enumerate(cached)
    for i, c in hits:
        out[i] = weight * (request_blocks - c if request_blocks > c else 0.0) + active[i]
    return out


def busy(loads: Sequence[WorkerLoad], params: CostParams) -> list[bool]:
    """Per worker: above the KV-use fraction of its reported capacity (none reported: never),
    or with more waiting requests than `busy_waiting_requests` (when that is > 0)."""
    fraction, waiting = params.busy_kv_fraction, params.busy_waiting_requests
    if waiting > 0:
        return [load.kv_usage > fraction or load.waiting_requests > waiting for load in loads]
    return [load.kv_usage > fraction for load in loads]


def available(workers: Mapping[str, WorkerLoad], params: CostParams) -> Mapping[str, WorkerLoad]:
    """The workers that are not busy, or all of them when every one is (a request then queues
    on the cheapest rather than failing), less those the herding guard leaves out."""
    saturated = busy(list(workers.values()), params)
    if any(saturated) and not all(saturated):
        workers = {w: load for (w, load), full in zip(workers.items(), saturated, strict=True) if not full}
    return balanced(workers, params)


def balanced(workers: Mapping[str, WorkerLoad], params: CostParams) -> Mapping[str, WorkerLoad]:
    """The herding guard: leave out the workers whose requests (in flight or reported, the
    predicted queue) exceed both `balance_rel` times and `balance_abs_requests` more than the
    least loaded worker's. A cache-affine cost can keep choosing the worker that holds a hot
    prefix while others idle (NVIDIA Dynamo users saw a KV router starve 2 of 5 workers,
    issue 7836); the cost's load term normally prevents it, and this bounds it when the hits
    outweigh the load term. Both margins must be passed, so small counts never trigger it."""
    margin = params.balance_abs_requests
    if not margin or len(workers) < 2:
        return workers
    counts = [load.requests for load in workers.values()]
    low = min(counts)
    bound = max(low * params.balance_rel, low + margin)
    if max(counts) <= bound:
        return workers
    return {w: load for w, load in workers.items() if load.requests <= bound}


def choose(costs: Sequence[float], loads: Sequence[int], temperature: float, rng: random.Random) -> int:
    """Index of the chosen candidate (`costs` is not empty)."""
    if temperature > 0:
        return _sample(costs, temperature, rng)
    best = min(costs)
    if costs.count(best) == 1:  # the usual case, answered without a Python loop
        return costs.index(best)
    tied = [i for i, c in enumerate(costs) if c == best]
    if len(tied) > 1:
        least = min(loads[i] for i in tied)
        tied = [i for i in tied if loads[i] == least]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def _sample(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    low, high = min(costs), max(costs)
    if high == low:
        return rng.randrange(len(costs))
    scale = (high - low) * temperature
    weights = [math.exp(-(c - low) / scale) for c in costs]
    return rng.choices(range(len(costs)), weights=weights)[0]
