"""The one place the frontend builds a router for a model.

Everything mode-specific lives here: the router itself (`router.make_router`) and, when an
event plane is given, the `RouterSubscriber` that feeds it KV events, load reports and
replica routers' in-flight counts, and resyncs a worker's part of the KV index from the
worker's snapshot. Without an event plane, `kv` mode predicts caches from its own decisions.

In `remote` mode a standalone router (`weir router`) decides (`router.remote.RemoteRouter`);
the local router, in `REMOTE_FALLBACK_MODE`, only keeps the worker set and places requests
while the standalone one cannot be reached. The rest of the frontend only sees
`ModelRouting.select` / `on_finish` and the local router's worker membership."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from orchestrator.frontend.config import REMOTE_FALLBACK_MODE, FrontendConfig
from orchestrator.runtime.events import EventPlane
from orchestrator.runtime.protocol import ModelCard
from orchestrator.runtime.request_plane import RequestPlaneClient
from router.avoid import select_avoiding
from router.metrics import RouterMetrics
from router.protocols import RouteRequest
from router.remote import RemoteRouter
from router.router import Router, make_router
from router.subscriber import FetchSnapshot, RouterSubscriber


@dataclass(slots=True)
class ModelRouting:
    router: Router
    subscriber: RouterSubscriber | None = None
    remote: RemoteRouter | None = None
    plane: RequestPlaneClient | None = None  # the remote router's connection

    async def select(self, request: RouteRequest, avoid: Collection[str] = ()) -> str:
        """The worker for `request`, never one of `avoid` (they already failed it)."""
        if self.remote is not None:
            return (await self.remote.select(request, avoid)).worker_id
        return select_avoiding(self.router, request, avoid).worker_id

    def on_finish(self, worker_id: str, request_id: str) -> None:
        (self.remote or self.router).on_finish(worker_id, request_id)

    async def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if self.plane is not None:
            await self.plane.close()
        if self.subscriber is not None:
            await self.subscriber.stop()


async def build_router(
    config: FrontendConfig,
    card: ModelCard,
    events: EventPlane | None,
    fetch_snapshot: FetchSnapshot,
    metrics: RouterMetrics,
) -> ModelRouting:
    remote = config.router_mode == "remote"
    mode = REMOTE_FALLBACK_MODE if remote else config.router_mode
    params = {} if remote else dict(config.router_params)  # the standalone router has its own
    if events is None:
        params.setdefault("kv_events", False)
    router = make_router(mode, card.block_size, model=card.name, metrics=metrics, **params)
    routing = ModelRouting(router)
    if events is not None:
        routing.subscriber = RouterSubscriber(router, events, config.namespace, card.name, fetch_snapshot)
        # No worker is registered yet (the model appears with its first worker), so this does
        # not wait: workers added later are synced from their snapshots in the background.
        await routing.subscriber.start()
    if remote:
        assert config.router_address is not None  # FrontendConfig checks it
        routing.plane = RequestPlaneClient(connect_timeout=1.0)
        routing.remote = RemoteRouter(routing.plane, config.router_address, card.name, router)
    return routing
