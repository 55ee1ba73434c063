"""The one place the frontend builds a model's routing (`router.table.ModelRoutes`).

Everything mode-specific lives here: the router itself (`router.make_router`) and, when an
event plane is given, the `RouterSubscriber` that feeds it KV events, load reports and
replica routers' in-flight counts, and resyncs a worker's part of the KV index from the
worker's snapshot. Without an event plane, `kv` mode predicts caches from its own decisions.

In `remote` mode a standalone router (`weir router`) decides (`router.remote.RemoteRouter`);
the local router, in `REMOTE_FALLBACK_MODE`, only keeps the worker set and places requests
while the standalone one cannot be reached. The rest of the frontend only sees
`ModelRoutes.select` / `on_finish` and the model's workers.

A model's prefill workers get a `ModelRoutes` of their own (`prefill=True`), built the same
way, except in `remote` mode: the standalone router routes whole requests only, so prefills
are placed here, KV-aware, from the event plane's KV events."""

from __future__ import annotations

from orchestrator.frontend.config import REMOTE_FALLBACK_MODE, FrontendConfig
from orchestrator.runtime.events import EventPlane
from orchestrator.runtime.protocol import ModelCard
from orchestrator.runtime.request_plane import RequestPlaneClient
from router.metrics import RouterMetrics
from router.remote import RemoteRouter
from router.router import make_router
from router.table import ModelRoutes


async def build_router(
    config: FrontendConfig,
    card: ModelCard,
    events: EventPlane | None,
    metrics: RouterMetrics,
    prefill: bool = False,
) -> ModelRoutes:
    remote = config.router_mode == "remote" and not prefill
    if config.router_mode != "remote":
        mode, params = config.router_mode, dict(config.router_params)
    else:  # the standalone router has its own parameters
        mode, params = ("kv" if prefill else REMOTE_FALLBACK_MODE), {}
    if events is None:
        params.setdefault("kv_events", False)
    router = make_router(mode, card.block_size, model=card.name, metrics=metrics, **params)
    routes = ModelRoutes(card.name, router)
    if events is not None:
        await routes.subscribe(events, config.namespace)
    if remote:
        assert config.router_address is not None  # FrontendConfig checks it
        routes.plane = RequestPlaneClient(
            connect_timeout=1.0, security=config.request_plane, max_backlog_bytes=config.stream_backlog_bytes
        )
        routes.remote = RemoteRouter(routes.plane, config.router_address, card.name, router)
    return routes
