"""Models come and go with their workers.

The registry is a `router.table.RoutingTable` following `Discovery.watch("worker")`: the first
worker of a model creates its entry (the preprocessor, loaded once per model path, from the
worker's files when the path is not on this machine: tokenizer_files.py; and its routing,
built by `routing`); the last worker leaving removes it. Worker clients are made by a
factory, so embedded workers are called in-process and remote ones over the request plane."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.frontend.admission import Admission
from orchestrator.frontend.config import FrontendConfig
from orchestrator.frontend.errors import ModelNotFound, Unavailable
from orchestrator.frontend.metrics import Metrics, ModelMetrics
from orchestrator.frontend.preprocessor import Preprocessor
from orchestrator.frontend.prompts import max_prompt_chars
from orchestrator.frontend.routing import build_router
from orchestrator.frontend.tokenizer_files import cache_root, tokenizer_dir
from orchestrator.runtime.events import EventPlane
from orchestrator.runtime.protocol import Instance, ModelCard
from orchestrator.runtime.request_plane import WorkerClient
from router.disagg import DisaggPolicy
from router.table import ModelRoutes, RoutingTable

log = logging.getLogger("weir.frontend")

ClientFactory = Callable[[Instance], WorkerClient]


@dataclass(slots=True)
class ModelEntry:
    name: str
    card: ModelCard
    routes: ModelRoutes  # its router and its workers' clients
    metrics: ModelMetrics
    admission: Admission  # its bounded queue in front of its workers
    preprocessor: Preprocessor | None
    disagg: DisaggPolicy  # once it has prefill workers: whether a request's prefill goes there
    max_prompt_chars: int = 0  # longer prompt texts cannot fit the context (prompts.py)
    created: int = field(default_factory=lambda: int(time.time()))

    def require_preprocessor(self) -> Preprocessor:
        if self.preprocessor is None:
            raise Unavailable(f"model {self.name!r} has no usable tokenizer (card.model_path)")
        return self.preprocessor


class ModelRegistry(RoutingTable[ModelEntry]):
    routes_prefill = True

    def __init__(
        self,
        config: FrontendConfig,
        client_factory: ClientFactory,
        events: EventPlane | None,
        metrics: Metrics,
    ) -> None:
        super().__init__(client_factory, log)
        self.config = config
        self.events = events
        self.metrics = metrics
        self._tokenizer_cache = cache_root(config.tokenizer_cache_dir)
        self._disagg = config.disaggregation

    def get(self, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            raise ModelNotFound(name)
        return entry

    # ------------------------------------------------------------------ the routing table's hooks

    async def _new_model(self, card: ModelCard, client: WorkerClient) -> ModelEntry:
        preprocessor, max_chars = await self._preprocessor(card, client)
        routes = await build_router(self.config, card, self.events, self.metrics.router)
        metrics = self.metrics.for_model(card.name)
        admission = Admission(self.config, routes, metrics)
        return ModelEntry(card.name, card, routes, metrics, admission, preprocessor, self._disagg, max_chars)

    def _routes(self, model: ModelEntry) -> ModelRoutes:
        return model.routes

    async def _new_prefill_pool(self, model: ModelEntry, card: ModelCard) -> ModelRoutes:
        return await build_router(self.config, card, self.events, self.metrics.router, prefill=True)

    async def _joined(self, model: ModelEntry, card: ModelCard, client: WorkerClient) -> None:
        if model.preprocessor is None:  # the first worker could not provide one: ask this one
            model.preprocessor, model.max_prompt_chars = await self._preprocessor(card, client)

    def _workers_changed(self, name: str) -> None:
        self.metrics.workers.set(self.worker_count)

    async def _preprocessor(self, card: ModelCard, client: WorkerClient) -> tuple[Preprocessor | None, int]:
        """The model's preprocessor and longest useful prompt text; (None, 0) if it has none."""
        if not card.model_path:
            return None, 0
        try:
            model_dir = await tokenizer_dir(card.name, card.model_path, client, self._tokenizer_cache)
            preprocessor = await asyncio.to_thread(Preprocessor.load, model_dir)
            return preprocessor, await asyncio.to_thread(max_prompt_chars, preprocessor, card.context_length)
        except Exception:
            log.exception("cannot load the tokenizer of %s (%s)", card.name, card.model_path)
            return None, 0
