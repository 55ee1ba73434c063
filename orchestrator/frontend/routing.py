"""The one place the frontend builds a router for a model.

Everything mode-specific (the KV indexer, the event-plane subscriber that feeds it KV events,
load reports and replica in-flight counts) is created and torn down here, so the rest of the
frontend only sees `Router.select` / `on_finish` / worker membership."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.frontend.config import FrontendConfig
from orchestrator.runtime.events import EventPlane
from orchestrator.runtime.protocol import ModelCard
from router.router import Router, make_router


@dataclass(slots=True)
class ModelRouting:
    router: Router

    async def close(self) -> None:
        """Stops whatever feeds the router (nothing yet for the load-only modes)."""


async def build_router(config: FrontendConfig, card: ModelCard, events: EventPlane | None) -> ModelRouting:
    router = make_router(config.router_mode, card.block_size, **config.router_params)
    return ModelRouting(router)
