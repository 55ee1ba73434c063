"""The routable workers of every model, each model with its own router: what a frontend and
the standalone router (`weir router`) both keep, written once.

`RoutingTable.apply` turns `Discovery.watch("worker")` events into membership: a model
appears with its first routable worker and goes with its last; a worker that restarted
elsewhere or now serves another card is removed and added again; a draining worker stays
known but gets no requests. Each model's `ModelRoutes` holds its `Router`, the
`RouterSubscriber` feeding it (when there is an event plane), a `RemoteRouter` when a
standalone router decides, and one client per worker, through which snapshots are fetched.

Roles: aggregated and decode workers take whole requests and share one pool (a decode worker
is a full engine, which is what a failed prefill falls back to); decode workers alone take
the second half of a disaggregated request (`decode_exclude`). Prefill workers form a pool of
their own, `ModelRoutes.prefill`, with its own router and subscriber, when the owner builds
one (`routes_prefill`, `_new_prefill_pool`; the standalone router does not, so it leaves
them out: a frontend places its prefills itself). A model lives while either pool has a worker.

Each model's `ModelRoutes` also keeps a circuit breaker per worker: a worker whose connection
was refused or lost (`trip`) is left out of every decision at once, not only the failed
request's, for a back-off of 1 s doubling to 10 s on each failed probe; the first request
placed on it after that is the probe. A successful call (`restore`) or a new discovery record
for the worker closes the breaker; the etcd lease stays the authority for removing it.

What else a model carries (the frontend's preprocessor and metrics) belongs to the owner: it
subclasses `RoutingTable` and builds its per-model value in `_new_model`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from orchestrator.runtime.discovery import Discovery, DiscoveryEvent
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.events import EventPlane
from orchestrator.runtime.protocol import Instance, KvSnapshot, ModelCard
from orchestrator.runtime.request_plane import RequestPlaneClient, WorkerClient
from router.disagg import Candidate
from router.protocols import Decision, NoWorkerAvailable, RouteRequest
from router.remote import RemoteRouter
from router.router import Router
from router.subscriber import RouterSubscriber

ROUTABLE_ROLES = ("aggregated", "prefill", "decode")
WHOLE_REQUEST_ROLES = ("aggregated", "decode")
BREAKER_BACKOFF_S = 1.0  # a tripped worker's first back-off, doubled after each failed probe
BREAKER_MAX_BACKOFF_S = 10.0


@dataclass(slots=True)
class _Trip:
    """An open breaker: no decision names the worker before `retry_at`, unless every worker left
    is tripped. `probing`: a request was placed on it after its back-off, and has not ended."""

    backoff_s: float
    retry_at: float
    probing: bool = False


@dataclass(slots=True, eq=False)
class ModelRoutes:
    """One model's routing: its router, what feeds it, and its workers' clients."""

    name: str
    router: Router  # with `remote`, places requests only while the standalone router is unreachable
    subscriber: RouterSubscriber | None = None
    remote: RemoteRouter | None = None
    plane: RequestPlaneClient | None = None  # the remote router's connection, closed with the model
    workers: dict[str, WorkerClient] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    trips: dict[str, _Trip] = field(default_factory=dict)  # workers whose breaker is open
    decode_workers: set[str] = field(default_factory=set)  # those of `workers` with the decode role
    prefill: ModelRoutes | None = None  # the prefill pool, while it has workers

    async def subscribe(self, events: EventPlane, namespace: str) -> None:
        """Feed the router from the event plane. Called before the first worker is added, so it
        does not wait: workers added later are synced from their snapshots in the background."""
        self.subscriber = RouterSubscriber(self.router, events, namespace, self.name, self.fetch_snapshot)
        await self.subscriber.start()

    async def select(self, request: RouteRequest, exclude: Collection[str] = ()) -> Decision:
        """The decision for `request`, never naming one of `exclude` (they already failed it)
        and avoiding tripped workers; when nothing else is left, the tripped one whose back-off
        ends first (the least recently tripped), then any, rather than no decision."""
        now = self.clock()
        tripped = {w for w, trip in self.trips.items() if now < trip.retry_at and w not in exclude}
        if not tripped:
            decision = await self._select(request, exclude)
        else:
            try:
                decision = await self._select(request, {*exclude, *tripped})
            except NoWorkerAvailable:
                oldest = min(tripped, key=lambda w: self.trips[w].retry_at)
                try:
                    decision = await self._select(request, {*exclude, *(tripped - {oldest})})
                except NoWorkerAvailable:
                    decision = await self._select(request, exclude)
        trip = self.trips.get(decision.worker_id)
        if trip is not None:  # the probe: others keep away until it ends
            trip.probing = True
            trip.retry_at = now + trip.backoff_s
        return decision

    async def _select(self, request: RouteRequest, exclude: Collection[str]) -> Decision:
        if self.remote is not None:
            return await self.remote.select(request, exclude)
        return self.router.select(request, exclude)

    def candidate(self, request: RouteRequest) -> Candidate | None:
        """This pool's best worker for `request` by predicted prefill work (`router.disagg`),
        deciding nothing: no load is counted, no index learns. Draining workers and those whose
        breaker is open are left out."""
        return self.router.candidate(request, self._unavailable())

    def decode_ready(self) -> bool:
        """Some decode worker can take a handover now."""
        skip = self._unavailable()
        return any(w not in skip for w in self.decode_workers)

    def decode_exclude(self) -> list[str]:
        """The workers a disaggregated request's decode must not go to: every non-decode one."""
        return [w for w in self.workers if w not in self.decode_workers]

    def _unavailable(self) -> set[str]:
        now = self.clock()
        tripped = {w for w, trip in self.trips.items() if now < trip.retry_at}
        return tripped | self.router.loads.draining if tripped else self.router.loads.draining

    def trip(self, worker_id: str) -> bool:
        """`worker_id`'s connection was refused or lost: leave it out of decisions for its
        back-off. True when this opened the breaker (not when it was open already, as when
        many requests on the same lost connection fail together)."""
        if worker_id not in self.workers:
            return False
        now = self.clock()
        trip = self.trips.get(worker_id)
        if trip is not None and not trip.probing and now < trip.retry_at:
            return False
        backoff = BREAKER_BACKOFF_S if trip is None else min(2 * trip.backoff_s, BREAKER_MAX_BACKOFF_S)
        self.trips[worker_id] = _Trip(backoff, now + backoff)
        return True

    def restore(self, worker_id: str) -> None:
        """A call to `worker_id` succeeded, or discovery wrote its record again: close its breaker."""
        self.trips.pop(worker_id, None)

    def on_finish(self, worker_id: str, request_id: str) -> None:
        (self.remote or self.router).on_finish(worker_id, request_id)

    def add_worker(self, instance: Instance, total_blocks: int, client: WorkerClient) -> None:
        self.workers[instance.instance_id] = client
        if instance.card is not None and instance.card.role == "decode":
            self.decode_workers.add(instance.instance_id)
        self.router.add_worker(instance.instance_id, total_blocks)
        self.router.set_draining(instance.instance_id, instance.draining)

    def remove_worker(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self.decode_workers.discard(worker_id)
        self.trips.pop(worker_id, None)
        self.router.remove_worker(worker_id)

    async def fetch_snapshot(self, worker_id: str) -> KvSnapshot:
        client = self.workers.get(worker_id)
        if client is None:
            raise EngineError("unavailable", f"worker {worker_id} of {self.name} is gone", retryable=True)
        return await client.kv_snapshot()

    async def close(self) -> None:
        if self.prefill is not None:
            await self.prefill.close()
        if self.remote is not None:
            self.remote.close()
        if self.plane is not None:
            await self.plane.close()
        if self.subscriber is not None:
            await self.subscriber.stop()


M = TypeVar("M")


class RoutingTable(Generic[M]):
    """Routable workers by model, following discovery. `M` is the owner's per-model value;
    `_routes` finds its `ModelRoutes`. Prefill workers are routed only by an owner that
    builds their pool (`routes_prefill`); the standalone router leaves them out."""

    routes_prefill = False

    def __init__(self, client_factory: Callable[[Instance], WorkerClient], log: logging.Logger) -> None:
        self.client_factory = client_factory
        self.models: dict[str, M] = {}
        self.instances: dict[str, Instance] = {}  # routable workers by instance id
        self._log = log
        self._applied = 0  # discovery events `follow` has applied (or logged as bad)
        self._progress = asyncio.Event()  # set after each of them

    @property
    def worker_count(self) -> int:
        return len(self.instances)

    # ------------------------------------------------------------------ the owner's part

    async def _new_model(self, card: ModelCard, client: WorkerClient) -> M:
        """The model's value, built when its first worker (`client`) appears."""
        raise NotImplementedError

    def _routes(self, model: M) -> ModelRoutes:
        raise NotImplementedError

    async def _new_prefill_pool(self, model: M, card: ModelCard) -> ModelRoutes:
        """The routing of the model's prefill workers, built when its first one appears (only
        called when `routes_prefill`)."""
        raise NotImplementedError

    async def _joined(self, model: M, card: ModelCard, client: WorkerClient) -> None:
        """Another worker of a known model appears (before it is routable)."""

    def _workers_changed(self, name: str) -> None:
        """Model `name` gained or lost a worker, or is gone (no longer in `models`)."""

    def _routable(self, card: ModelCard) -> bool:
        return card.role in WHOLE_REQUEST_ROLES or (card.role == "prefill" and self.routes_prefill)

    def _pool(self, model: M, role: str) -> ModelRoutes | None:
        routes = self._routes(model)
        return routes.prefill if role == "prefill" else routes

    # ------------------------------------------------------------------ discovery

    async def follow(self, discovery: Discovery) -> None:
        """Apply discovery events until cancelled. One bad event is logged, never fatal."""
        async for event in discovery.watch("worker"):
            try:
                await self.apply(event)
            except Exception:
                self._log.exception("could not apply discovery event for %s", event.instance.instance_id)
            self._applied += 1
            self._progress.set()

    async def caught_up(self, discovery: Discovery) -> None:
        """Return once `follow` has applied as many events as there were workers registered
        when this was called: the watch yields the registered workers first, so by then each
        is routable or was logged as bad. The caller bounds the wait (a worker may leave
        meanwhile, and its event never comes)."""
        registered = len(await discovery.list("worker"))
        while self._applied < registered:
            self._progress.clear()
            await self._progress.wait()

    async def apply(self, event: DiscoveryEvent) -> None:
        instance = event.instance
        card = instance.card
        if event.kind == "delete" or card is None or not self._routable(card):
            await self.remove_worker(instance.instance_id)
            return
        known = self.instances.get(instance.instance_id)
        if known is not None and known.card == card and known.address == instance.address:
            self.instances[instance.instance_id] = instance
            pool = self._pool(self.models[card.name], card.role)
            assert pool is not None  # it holds this known worker
            pool.router.set_draining(instance.instance_id, instance.draining)
            pool.restore(instance.instance_id)  # it registered again: worth a try at once
            return
        if known is not None:  # restarted elsewhere, or now serving something else
            await self.remove_worker(instance.instance_id)
        await self.add_worker(instance, card)

    async def add_worker(self, instance: Instance, card: ModelCard) -> None:
        client = self.client_factory(instance)
        model = self.models.get(card.name)
        if model is None:
            # `follow` applies events one at a time, so no other event creates it meanwhile.
            model = self.models[card.name] = await self._new_model(card, client)
        else:
            await self._joined(model, card, client)
        pool = self._pool(model, card.role)
        if pool is None:
            pool = self._routes(model).prefill = await self._new_prefill_pool(model, card)
        pool.add_worker(instance, card.total_kv_blocks, client)
        self.instances[instance.instance_id] = instance
        self._workers_changed(card.name)
        self._log.info(
            "%s worker %s serves %s at %s",
            card.role,
            instance.instance_id,
            card.name,
            instance.address or "in-process",
        )

    async def remove_worker(self, instance_id: str) -> None:
        instance = self.instances.pop(instance_id, None)
        if instance is None or instance.card is None:
            return
        name = instance.card.name
        routes = self._routes(self.models[name])
        prefill = routes.prefill
        if instance.card.role == "prefill" and prefill is not None:
            prefill.remove_worker(instance_id)
            if not prefill.workers:
                routes.prefill = None
                await prefill.close()
        else:
            routes.remove_worker(instance_id)
        gone = not routes.workers and routes.prefill is None
        if gone:
            del self.models[name]
        self._workers_changed(name)
        self._log.info("worker %s of %s is gone", instance_id, name)
        if gone:
            await routes.close()
            self._log.info("model %s has no workers left", name)

    async def close(self) -> None:
        """Forget every model and worker, closing each model's routing."""
        models = list(self.models.items())
        self.models.clear()
        self.instances.clear()
        for name, model in models:
            self._workers_changed(name)
            await self._routes(model).close()
