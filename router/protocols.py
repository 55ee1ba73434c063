"""What the router is asked and what it answers, plus its one wire message."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from router.step_time import StepTime


@dataclass(slots=True)
class RouteRequest:
    """One request to place. `block_hashes` are the prompt's sequence hashes at the model
    card's block size (computed once by the preprocessor)."""

    request_id: str
    num_tokens: int
    block_hashes: list[int] = field(default_factory=list)
    pinned_worker: str | None = None  # `direct` mode


@dataclass(slots=True)
class Decision:
    worker_id: str
    overlap_blocks: int = 0  # prompt blocks the chosen worker already caches
    cost: float = 0.0
    best_overlap_blocks: int = 0  # the most any candidate worker caches


@dataclass(slots=True)
class WorkerLoad:
    """A worker's load as the router knows it: its last load report (`active_*`, `waiting_*`,
    `total_blocks`) and the requests routers sent it that have not finished (`inflight_*`,
    this router's own plus its replicas')."""

    active_requests: int = 0
    waiting_requests: int = 0
    active_blocks: int = 0
    total_blocks: int = 0
    queued_prefill_tokens: int = 0  # from the last report: prompt tokens waiting for prefill
    # The worker's own step time curve, from its last report that had one; None: the default.
    step_time: StepTime | None = None
    # Uncached prompt tokens this router sent the worker since that report, which it cannot
    # count yet: without them a burst inside one report interval looks like no prefill at all.
    routed_prefill_tokens: int = 0
    draining: bool = False
    inflight_requests: int = 0
    inflight_blocks: int = 0
    # What the router acts on, kept by `refresh()` after every change (read per worker on
    # every decision, so stored rather than computed). A report lags the router's own count;
    # the router's count misses routers that share no load: the larger is the better guess.
    requests: int = 0
    blocks: int = 0
    kv_usage: float = 0.0  # blocks / total_blocks; 0 while the capacity is unknown
    prefill_tokens: int = 0  # queued + routed prefill tokens

    def refresh(self) -> None:
        self.prefill_tokens = self.queued_prefill_tokens + self.routed_prefill_tokens
        self.requests = max(self.inflight_requests, self.active_requests + self.waiting_requests)
        self.blocks = max(self.inflight_blocks, self.active_blocks)
        self.kv_usage = self.blocks / self.total_blocks if self.total_blocks else 0.0


class InflightUpdate(msgspec.Struct, kw_only=True):
    """Published by a router on `weir.<ns>.<model>.inflight` when it sends a request to a
    worker (`done=False`) and when the request ends (`done=True`), so replicas count it."""

    router_id: str
    worker_id: str
    request_id: str
    blocks: int = 0
    done: bool = False


class RouterHeartbeat(msgspec.Struct, kw_only=True):
    """Published by a router on `weir.<ns>.<model>.routers` every `HEARTBEAT_S`, and at once
    when it hears a replica it did not know: routers publish `InflightUpdate`s only while
    another replica is listening."""

    router_id: str


class NoWorkerAvailable(Exception):
    """No worker can take the request (none registered, or all filtered out)."""
