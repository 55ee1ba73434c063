"""The one place the frontend builds a router for a model.

Everything mode-specific lives here: the router itself (`router.make_router`) and, when an
event plane is given, the `RouterSubscriber` that feeds it KV events, load reports and
replica routers' in-flight counts, and resyncs a worker's part of the KV index from the
worker's snapshot. Without an event plane, `kv` mode predicts caches from its own decisions.
The rest of the frontend only sees `Router.select` / `on_finish` / worker membership."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.frontend.config import FrontendConfig
from orchestrator.runtime.events import EventPlane
from orchestrator.runtime.protocol import ModelCard
from router.metrics import RouterMetrics
from router.router import Router, make_router
from router.subscriber import FetchSnapshot, RouterSubscriber


@dataclass(slots=True)
class ModelRouting:
    router: Router
    subscriber: RouterSubscriber | None = None

    async def close(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.stop()


async def build_router(
    config: FrontendConfig,
    card: ModelCard,
    events: EventPlane | None,
    fetch_snapshot: FetchSnapshot,
    metrics: RouterMetrics,
) -> ModelRouting:
    params = dict(config.router_params)
    if events is None:
        params.setdefault("kv_events", False)
    router = make_router(config.router_mode, card.block_size, model=card.name, metrics=metrics, **params)
    if events is None:
        return ModelRouting(router)
    subscriber = RouterSubscriber(router, events, config.namespace, card.name, fetch_snapshot)
    # No worker is registered yet (the model appears with its first worker), so this does not
    # wait: workers added later are synced from their snapshots in the background.
    await subscriber.start()
    return ModelRouting(router, subscriber)
