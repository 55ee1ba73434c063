"""The router as its own process (`weir router`): the `Router` library behind two
request-plane endpoints, so frontends can share one KV index instead of each keeping one.

Per model it keeps a `Router` (`make_router`) fed by a `RouterSubscriber` (KV events, load
reports, replicas' in-flight load; worker snapshots fetched over the request plane), and the
model's workers from `Discovery.watch("worker")`: a model appears with its first worker and
goes with its last, draining workers stay known but get no requests. It serves `route`
(`router.endpoints`) and registers itself as `Instance(component="router")`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Gauge

from orchestrator.runtime.discovery import Discovery, DiscoveryEvent, DiscoveryUnavailable
from orchestrator.runtime.events import EventPlane
from orchestrator.runtime.protocol import Instance, KvSnapshot, ModelCard
from orchestrator.runtime.request_plane import (
    RemoteError,
    RequestPlaneClient,
    RequestPlaneServer,
    TcpWorkerClient,
    dial_address,
)
from router.avoid import select_avoiding
from router.endpoints import ROUTE, RouteAnswer, RouteCall
from router.metrics import RouterMetrics, default_metrics
from router.protocols import NoWorkerAvailable, RouteRequest
from router.router import Router, make_router
from router.subscriber import RouterSubscriber

log = logging.getLogger(__name__)

# Roles that take whole requests; prefill/decode pools need the disaggregated path.
ROUTABLE_ROLES = ("aggregated",)

WORKERS = Gauge("weir_router_workers", "Workers of the model in discovery, draining ones included", ["model"])

_encode = msgspec.msgpack.Encoder().encode
_decode_route = msgspec.msgpack.Decoder(RouteCall).decode


@dataclass(slots=True)
class _Model:
    router: Router
    subscriber: RouterSubscriber
    addresses: dict[str, str]  # worker id -> request-plane address


class RouterService:
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
    ) -> None:
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
        self.instance_id = instance_id or f"router-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.metrics = metrics or default_metrics()
        self.instance: Instance | None = None
        self.models: dict[str, _Model] = {}
        self._workers: dict[str, Instance] = {}  # routable workers by instance id
        self._plane = RequestPlaneClient()
        self._server = RequestPlaneServer({ROUTE: self._route})
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
        self._follower = asyncio.create_task(self._follow(), name="router-discovery")
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
        for name, model in self.models.items():
            WORKERS.remove(name)
            await model.subscriber.stop()
        self.models.clear()
        self._workers.clear()
        await self._plane.close()

    # ------------------------------------------------------------------ workers

    async def _follow(self) -> None:
        async for event in self.discovery.watch("worker"):
            try:
                await self.apply(event)
            except Exception:  # one bad event must not stop the router following discovery
                log.exception("could not apply discovery event for %s", event.instance.instance_id)

    async def apply(self, event: DiscoveryEvent) -> None:
        instance = event.instance
        card = instance.card
        if event.kind == "delete" or card is None or card.role not in ROUTABLE_ROLES:
            await self._remove_worker(instance.instance_id)
            return
        known = self._workers.get(instance.instance_id)
        if known is not None and known.card == card and known.address == instance.address:
            self._workers[instance.instance_id] = instance
            self.models[card.name].router.set_draining(instance.instance_id, instance.draining)
            return
        if known is not None:  # restarted elsewhere, or now serving something else
            await self._remove_worker(instance.instance_id)
        model = self.models.get(card.name)
        if model is None:
            model = self.models[card.name] = await self._new_model(card)
        model.addresses[instance.instance_id] = instance.address
        model.router.add_worker(instance.instance_id, card.total_kv_blocks)
        model.router.set_draining(instance.instance_id, instance.draining)
        self._workers[instance.instance_id] = instance
        WORKERS.labels(card.name).set(len(model.addresses))
        log.info("worker %s serves %s at %s", instance.instance_id, card.name, instance.address)

    async def _remove_worker(self, instance_id: str) -> None:
        instance = self._workers.pop(instance_id, None)
        if instance is None or instance.card is None:
            return
        name = instance.card.name
        model = self.models[name]
        model.addresses.pop(instance_id, None)
        model.router.remove_worker(instance_id)
        WORKERS.labels(name).set(len(model.addresses))
        log.info("worker %s of %s is gone", instance_id, name)
        if not model.addresses:
            del self.models[name]
            WORKERS.remove(name)
            await model.subscriber.stop()

    async def _new_model(self, card: ModelCard) -> _Model:
        addresses: dict[str, str] = {}

        async def fetch_snapshot(worker_id: str) -> KvSnapshot:
            address = addresses.get(worker_id)
            if address is None:
                raise RemoteError("unavailable", f"worker {worker_id} of {card.name} is gone", retryable=True)
            return await TcpWorkerClient(self._plane, address).kv_snapshot()

        router = make_router(self.mode, card.block_size, model=card.name, metrics=self.metrics, **self.params)
        subscriber = RouterSubscriber(router, self.events, self.namespace, card.name, fetch_snapshot)
        # No worker is registered yet, so this does not wait for snapshots.
        await subscriber.start()
        return _Model(router, subscriber, addresses)

    # ------------------------------------------------------------------ endpoints

    async def _route(self, payload: bytes) -> AsyncIterator[bytes]:
        try:
            call = _decode_route(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteError("invalid_request", f"bad RouteCall: {exc}") from exc
        model = self.models.get(call.model)
        if model is None:
            raise RemoteError("invalid_request", f"the router knows no worker of model {call.model!r}")
        request = RouteRequest(call.request_id, call.num_tokens, call.block_hashes, call.pinned_worker)
        try:
            decision = select_avoiding(model.router, request, call.avoid)
        except NoWorkerAvailable as exc:
            raise RemoteError("unavailable", f"{call.model}: {exc}") from exc
        try:
            yield _encode(
                RouteAnswer(
                    worker_id=decision.worker_id,
                    address=model.addresses[decision.worker_id],
                    overlap_blocks=decision.overlap_blocks,
                    best_overlap_blocks=decision.best_overlap_blocks,
                    cost=decision.cost,
                )
            )
            # The request runs until the caller closes this stream (or its connection drops):
            # only then is its load released.
            await asyncio.get_running_loop().create_future()
        finally:
            model.router.on_finish(decision.worker_id, call.request_id)
