"""The `Router` facade: keeps the worker set, their load and (in `kv` mode) the KV index,
and asks the policy to pick.

The frontend calls `select` before dispatching and `on_finish` when a request ends, so the
router counts its own in-flight requests between workers' load reports. The event-plane
side (`router.subscriber`) feeds `apply_kv_batch`, `apply_kv_snapshot`, `apply_load` and
`apply_inflight`, and publishes what `on_inflight` hands it to replica routers.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import Any

from orchestrator.runtime.protocol import KvEventBatch, KvSnapshot, LoadReport
from router.approx import ApproxIndexer
from router.cost import CostParams
from router.disagg import Candidate, best_candidate
from router.indexer import KvIndexer
from router.load import LoadTracker
from router.metrics import RouterMetrics, default_metrics
from router.policies.base import Policy
from router.policies.direct import DirectPolicy
from router.policies.kv import KvPolicy, OverlapIndex
from router.policies.least_loaded import LeastLoadedPolicy
from router.policies.random import RandomPolicy
from router.policies.round_robin import RoundRobinPolicy
from router.policies.ttft import TtftPolicy
from router.protocols import Decision, InflightUpdate, NoWorkerAvailable, RouteRequest, WorkerLoad

MODES = ("kv", "ttft", "round-robin", "random", "least-loaded", "direct")
log = logging.getLogger(__name__)


def make_policy(
    mode: str,
    *,
    index: OverlapIndex | None = None,
    block_size: int = 64,
    params: CostParams | None = None,
    seed: int | None = None,
) -> Policy:
    if mode in ("kv", "ttft"):
        if index is None:
            raise ValueError(f"{mode} routing needs an index (use make_router)")
        if mode == "ttft":
            return TtftPolicy(index, block_size, params or CostParams(), seed=seed)
        return KvPolicy(index, block_size, params or CostParams(), seed=seed)
    if mode == "round-robin":
        return RoundRobinPolicy()
    if mode == "random":
        return RandomPolicy(seed)
    if mode == "least-loaded":
        return LeastLoadedPolicy()
    if mode == "direct":
        return DirectPolicy()
    raise ValueError(f"unknown router mode {mode!r}; choose one of {', '.join(MODES)}")


def make_router(
    mode: str,
    block_size: int = 64,
    *,
    kv_events: bool = True,
    approx_ttl_s: float = 120.0,
    approx_max_blocks: int = 1_000_000,
    seed: int | None = None,
    router_id: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    model: str = "",
    metrics: RouterMetrics | None = None,
    **cost_params: Any,
) -> Router:
    """A router for `mode`. In `kv` mode, `kv_events=False` predicts caches from decisions
    (`ApproxIndexer`); `cost_params` are `CostParams` fields (overlap_weight, temperature, ...).
    `clock` (seconds) times prediction and replica-load expiry: trace replay passes virtual time.
    `metrics` defaults to series on prometheus' default registry, labelled with `model`."""
    index: KvIndexer | ApproxIndexer | None = None
    if mode in ("kv", "ttft"):
        index = KvIndexer() if kv_events else ApproxIndexer(approx_ttl_s, approx_max_blocks, clock)
    params = CostParams(**cost_params)
    policy = make_policy(mode, index=index, block_size=block_size, params=params, seed=seed)
    return Router(
        policy,
        block_size=block_size,
        index=index,
        router_id=router_id,
        mode=mode,
        clock=clock,
        model=model,
        metrics=metrics,
    )


class Router:
    def __init__(
        self,
        policy: Policy,
        *,
        block_size: int = 64,
        index: KvIndexer | ApproxIndexer | None = None,
        router_id: str | None = None,
        mode: str = "custom",
        clock: Callable[[], float] = time.monotonic,
        model: str = "",
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.policy = policy
        self.index = index
        self.mode = mode
        self.block_size = block_size
        self.loads = LoadTracker(router_id or uuid.uuid4().hex, block_size, clock=clock)
        self.workers = self.loads.workers
        if isinstance(index, KvIndexer):
            index.inflight = self.loads.held  # covers the lag of workers' KV events
        # Set by the subscriber to share in-flight load with replica routers.
        self.on_inflight: Callable[[InflightUpdate], None] | None = None
        # Set by the frontend's admission control: a report may show a worker with room again.
        self.on_load: Callable[[], None] | None = None
        m = metrics or default_metrics()
        self.metrics = m
        self.model = model
        # children resolved once: label lookups cost more than the increments
        self._decisions = m.decisions.labels(model, mode)
        self._decision_seconds = m.decision_seconds.labels(model, mode)
        self._prompt_blocks = m.prompt_blocks.labels(model, mode)
        self._chosen_overlap = m.chosen_overlap_blocks.labels(model, mode)
        self._best_overlap = m.best_overlap_blocks.labels(model, mode)
        self._predicted_ttft = m.predicted_ttft.labels(model, mode) if mode == "ttft" else None
        self._kv_events = m.kv_events.labels(model)

    # ------------------------------------------------------------------ workers

    def add_worker(self, worker_id: str, total_blocks: int = 0) -> None:
        self.loads.add_worker(worker_id, total_blocks)
        if self.index is not None:
            self.index.add_worker(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        self.loads.remove_worker(worker_id)
        if self.index is not None:
            self.index.remove_worker(worker_id)

    def set_draining(self, worker_id: str, draining: bool) -> None:
        self.loads.set_draining(worker_id, draining)

    # ------------------------------------------------------------------ requests

    def select(self, request: RouteRequest, exclude: Collection[str] = ()) -> Decision:
        """Pick a worker for `request`, never a draining one nor one of `exclude` (workers
        that already failed this request, or that the caller cannot reach)."""
        started = time.perf_counter()
        # The worker dict itself unless some are left out: no per-decision copy in the usual case.
        candidates: Mapping[str, WorkerLoad] = self.workers
        draining = self.loads.draining
        if draining or exclude:
            candidates = {w: load for w, load in candidates.items() if w not in draining and w not in exclude}
        if not candidates:
            raise NoWorkerAvailable("no worker is available for this model")
        if isinstance(self.index, KvIndexer) and self.index.joining:
            # Until its snapshot arrives a worker's cache is unknown: do not mistake it for cold.
            joining = self.index.joining
            candidates = {w: load for w, load in candidates.items() if w not in joining} or candidates
        decision = self.policy.select(request, candidates)
        update = self.loads.on_routed(decision.worker_id, request, decision.overlap_blocks)
        if self.on_inflight is not None:
            self.on_inflight(update)
        self._decisions.inc()
        self._decision_seconds.observe(time.perf_counter() - started)
        self._prompt_blocks.inc(len(request.block_hashes))
        self._chosen_overlap.inc(decision.overlap_blocks)
        self._best_overlap.inc(decision.best_overlap_blocks)
        if self._predicted_ttft is not None:  # the ttft policy's cost is its prediction, in ms
            self._predicted_ttft.observe(decision.cost / 1e3)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route %s -> %s overlap=%d/%d best=%d cost=%.1f",
                request.request_id,
                decision.worker_id,
                decision.overlap_blocks,
                len(request.block_hashes),
                decision.best_overlap_blocks,
                decision.cost,
            )
        return decision

    def candidate(self, request: RouteRequest, skip: Collection[str] = ()) -> Candidate | None:
        """The best worker for `request` by predicted prefill work (`router.disagg`), less
        `skip` and draining workers, deciding nothing: no load is counted, no index learns."""
        hits = self.index.find_matches(request.block_hashes).blocks if self.index is not None else {}
        if self.loads.draining:
            skip = {*skip, *self.loads.draining}
        return best_candidate(request.num_tokens, self.block_size, hits, self.workers, skip)

    def on_finish(self, worker_id: str, request_id: str | None = None) -> None:
        """A request ended. Pass its id so its exact blocks are released; without one the
        oldest request on that worker is."""
        update = self.loads.on_finish(worker_id, request_id)
        if update is not None and self.on_inflight is not None:
            self.on_inflight(update)

    # ------------------------------------------------------------------ event plane

    def apply_kv_batch(self, batch: KvEventBatch) -> bool:
        """True when the worker needs a resync from its snapshot."""
        if not isinstance(self.index, KvIndexer):
            return False
        if batch.worker_id not in self.workers:
            return False  # not (or no longer) in discovery: a late event from a dead worker
        before = self.index.events_applied
        gap = self.index.apply_batch(batch)
        self._kv_events.inc(self.index.events_applied - before)
        return gap

    def apply_kv_snapshot(self, snapshot: KvSnapshot) -> bool:
        """True when a gap remains after the snapshot (fetch another)."""
        if not isinstance(self.index, KvIndexer) or snapshot.worker_id not in self.workers:
            return False
        return self.index.apply_snapshot(snapshot)

    def needs_resync(self) -> list[str]:
        return self.index.needs_resync() if self.index is not None else []

    def apply_load(self, report: LoadReport) -> bool:
        """True when the report shows the worker's KV events have a gap (resync it)."""
        self.loads.apply_report(report)
        if self.on_load is not None:
            self.on_load()
        if isinstance(self.index, KvIndexer) and report.kv_event_id and report.worker_id in self.workers:
            return self.index.observe_event_id(report.worker_id, report.kv_event_id)
        return False

    @property
    def router_id(self) -> str:
        return self.loads.router_id

    def apply_inflight(self, update: InflightUpdate) -> None:
        self.loads.apply_peer(update)

    def inflight_updates(self) -> list[InflightUpdate]:
        """This router's requests in flight, for a replica that has just appeared."""
        return self.loads.inflight_updates()

    def forget_peer(self, router_id: str) -> None:
        self.loads.forget_peer(router_id)
