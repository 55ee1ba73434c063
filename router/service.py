"""The router as its own process (`weir router`): the `Router` library behind two
request-plane endpoints, so frontends can share one KV index instead of each keeping one.

It is a `RoutingTable` (`router.table`): per model a `Router` (`make_router`) fed by a
`RouterSubscriber` (KV events, load reports, replicas' in-flight load; worker snapshots
fetched over the request plane), and the model's workers from `Discovery.watch("worker")`: a
model appears with its first worker and goes with its last, draining workers stay known but
get no requests. It serves `route` (`router.endpoints`) and registers itself as
`Instance(component="router")`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Gauge

from orchestrator.runtime.discovery import Discovery, DiscoveryUnavailable
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.events import EventPlane
from orchestrator.runtime.protocol import Instance, ModelCard
from orchestrator.runtime.request_plane import (
    PlaneSecurity,
    RequestPlaneClient,
    RequestPlaneServer,
    TcpWorkerClient,
    WorkerClient,
    dial_address,
)
from orchestrator.runtime.worker_host import default_instance_id
from router.endpoints import ROUTE, RouteAnswer, RouteCall
from router.metrics import RouterMetrics, default_metrics
from router.protocols import NoWorkerAvailable, RouteRequest
from router.router import make_router
from router.table import ModelRoutes, RoutingTable

log = logging.getLogger(__name__)

WORKERS = Gauge("weir_router_workers", "Workers of the model in discovery, draining ones included", ["model"])

_encode = msgspec.msgpack.Encoder().encode
_decode_route = msgspec.msgpack.Decoder(RouteCall).decode


class RouterService(RoutingTable[ModelRoutes]):
    def __init__(
        self,
        discovery: Discovery,
        events: EventPlane,
        namespace: str,
        mode: str = "kv",
        params: dict[str, Any] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        instance_id: str | None = None,
        metrics: RouterMetrics | None = None,
        security: PlaneSecurity | None = None,
    ) -> None:
        super().__init__(lambda instance: TcpWorkerClient(self._plane, instance.address), log)
        # To the workers, for their KV snapshots; the same secret and limits as the server.
        self._plane = RequestPlaneClient(security=security)
        self.discovery = discovery
        self.events = events
        self.namespace = namespace
        self.mode = mode
        self.params = dict(params or {})
        # Bad modes or parameters fail here, not at the first worker (a throwaway registry: no
        # series for a model that does not exist).
        make_router(mode, metrics=RouterMetrics(CollectorRegistry()), **self.params)
        self.host = host
        self.port = port
        self.advertise_host = advertise_host
        self.instance_id = instance_id or f"router-{default_instance_id()}"
        self.metrics = metrics or default_metrics()
        self.instance: Instance | None = None
        self._server = RequestPlaneServer({ROUTE: self._route}, security)
        # Per model, the card its first worker brought: what `route` calls are checked against.
        self._cards: dict[str, ModelCard] = {}
        self._follower: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return self.instance.address if self.instance is not None else ""

    @property
    def ready(self) -> bool:
        return self.instance is not None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        port = await self._server.start(self.host, self.port)
        self._follower = asyncio.create_task(self.follow(self.discovery), name="router-discovery")
        instance = Instance(
            instance_id=self.instance_id,
            component="router",
            address=dial_address(self.host, port, self.advertise_host),
        )
        await self.discovery.register(instance)
        self.instance = instance
        log.info("router %s (%s) at %s", self.instance_id, self.mode, self.address)

    async def stop(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
        with contextlib.suppress(DiscoveryUnavailable):
            await self.discovery.deregister(self.instance_id)
        self.instance = None
        await self._server.stop()
        await self.close()
        await self._plane.close()

    # ------------------------------------------------------------------ the routing table's hooks

    async def _new_model(self, card: ModelCard, client: WorkerClient) -> ModelRoutes:
        router = make_router(self.mode, card.block_size, model=card.name, metrics=self.metrics, **self.params)
        routes = ModelRoutes(card.name, router)
        await routes.subscribe(self.events, self.namespace)
        self._cards[card.name] = card
        return routes

    def _routes(self, model: ModelRoutes) -> ModelRoutes:
        return model

    def _workers_changed(self, name: str) -> None:
        model = self.models.get(name)
        if model is None:
            self._cards.pop(name, None)
            WORKERS.remove(name)
        else:
            WORKERS.labels(name).set(len(model.workers))

    # ------------------------------------------------------------------ endpoints

    async def _route(self, payload: bytes) -> AsyncGenerator[bytes, None]:
        try:
            call = _decode_route(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise EngineError("invalid_request", f"bad RouteCall: {exc}") from exc
        model = self.models.get(call.model)
        if model is None:
            raise EngineError("invalid_request", f"the router knows no worker of model {call.model!r}")
        _check(call, self._cards[call.model])
        request = RouteRequest(call.request_id, call.num_tokens, call.block_hashes, call.pinned_worker)
        try:
            decision = await model.select(request, call.exclude)
        except NoWorkerAvailable as exc:
            raise EngineError("unavailable", f"{call.model}: {exc}") from exc
        try:
            yield _encode(
                RouteAnswer(
                    worker_id=decision.worker_id,
                    address=self.instances[decision.worker_id].address,
                    overlap_blocks=decision.overlap_blocks,
                    best_overlap_blocks=decision.best_overlap_blocks,
                    cost=decision.cost,
                )
            )
            # The request runs until the caller closes this stream (or its connection drops):
            # only then is its load released.
            await asyncio.get_running_loop().create_future()
        finally:
            model.on_finish(decision.worker_id, call.request_id)


def _check(call: RouteCall, card: ModelCard) -> None:
    """A call's load must be one a real prompt could have: its token count adds to every
    candidate worker's predicted load, so an absurd one would skew routing for everyone. The
    hashes cannot be checked against tokens the router never sees; the worker does that."""
    if not 0 <= call.num_tokens <= card.context_length:
        raise EngineError(
            "invalid_request", f"num_tokens {call.num_tokens} is outside [0, {card.context_length}]"
        )
    if len(call.block_hashes) > call.num_tokens // card.block_size:
        raise EngineError(
            "invalid_request",
            f"{len(call.block_hashes)} block hashes for {call.num_tokens} tokens of "
            f"{card.block_size}-token blocks",
        )
