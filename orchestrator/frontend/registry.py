"""Models come and go with their workers.

The registry follows `Discovery.watch("worker")`: the first worker of a model creates its
entry (the preprocessor, loaded once per model path, from the worker's files when the path is
not on this machine: tokenizer_files.py; and a router built by `routing`); the last worker
leaving removes it. Worker clients are made by a factory, so embedded workers are
called in-process and remote ones over the request plane."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from orchestrator.frontend.config import FrontendConfig
from orchestrator.frontend.errors import ModelNotFound, Unavailable
from orchestrator.frontend.metrics import Metrics, ModelMetrics
from orchestrator.frontend.preprocessor import Preprocessor
from orchestrator.frontend.prompts import max_prompt_chars
from orchestrator.frontend.routing import ModelRouting, build_router
from orchestrator.frontend.tokenizer_files import cache_root, tokenizer_dir
from orchestrator.runtime.discovery import Discovery, DiscoveryEvent
from orchestrator.runtime.events import EventPlane
from orchestrator.runtime.protocol import Instance, KvSnapshot, ModelCard
from orchestrator.runtime.request_plane import RemoteError, WorkerClient

log = logging.getLogger("weir.frontend")

ClientFactory = Callable[[Instance], WorkerClient]

# Roles the frontend sends whole requests to; prefill/decode pools need the disaggregated path.
_ROUTABLE_ROLES = ("aggregated",)


@dataclass(slots=True)
class ModelEntry:
    name: str
    card: ModelCard
    routing: ModelRouting
    metrics: ModelMetrics
    preprocessor: Preprocessor | None
    max_prompt_chars: int = 0  # longer prompt texts cannot fit the context (prompts.py)
    created: int = field(default_factory=lambda: int(time.time()))
    workers: dict[str, WorkerClient] = field(default_factory=dict)

    def require_preprocessor(self) -> Preprocessor:
        if self.preprocessor is None:
            raise Unavailable(f"model {self.name!r} has no usable tokenizer (card.model_path)")
        return self.preprocessor


class ModelRegistry:
    def __init__(
        self,
        config: FrontendConfig,
        client_factory: ClientFactory,
        events: EventPlane | None,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.client_factory = client_factory
        self.events = events
        self.metrics = metrics
        self.models: dict[str, ModelEntry] = {}
        self._workers: dict[str, Instance] = {}  # routable workers by instance id
        self._tokenizer_cache = cache_root(config.tokenizer_cache_dir)

    def get(self, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            raise ModelNotFound(name)
        return entry

    @property
    def worker_count(self) -> int:
        return len(self._workers)

    async def follow(self, discovery: Discovery) -> None:
        """Apply discovery events until cancelled. One bad event is logged, never fatal."""
        async for event in discovery.watch("worker"):
            try:
                await self.apply(event)
            except Exception:
                log.exception("could not apply discovery event for %s", event.instance.instance_id)

    async def apply(self, event: DiscoveryEvent) -> None:
        instance = event.instance
        if event.kind == "delete":
            await self.remove_worker(instance.instance_id)
            return
        card = instance.card
        if card is None or card.role not in _ROUTABLE_ROLES:
            await self.remove_worker(instance.instance_id)
            return
        known = self._workers.get(instance.instance_id)
        if known is not None and known.card == card and known.address == instance.address:
            self._workers[instance.instance_id] = instance
            self.models[card.name].routing.router.set_draining(instance.instance_id, instance.draining)
            return
        if known is not None:  # restarted elsewhere, or now serving something else
            await self.remove_worker(instance.instance_id)
        await self.add_worker(instance, card)

    async def add_worker(self, instance: Instance, card: ModelCard) -> None:
        client = self.client_factory(instance)
        entry = self.models.get(card.name)
        if entry is None:
            # `follow` applies events one at a time, so no other event creates it meanwhile.
            entry = self.models[card.name] = await self._new_model(card, client)
        elif entry.preprocessor is None:  # the first worker could not provide one: ask this one
            entry.preprocessor, entry.max_prompt_chars = await self._preprocessor(card, client)
        entry.workers[instance.instance_id] = client
        router = entry.routing.router
        router.add_worker(instance.instance_id, card.total_kv_blocks)
        router.set_draining(instance.instance_id, instance.draining)
        self._workers[instance.instance_id] = instance
        self.metrics.workers.set(self.worker_count)
        log.info(
            "worker %s serves %s at %s", instance.instance_id, card.name, instance.address or "in-process"
        )

    async def remove_worker(self, instance_id: str) -> None:
        instance = self._workers.pop(instance_id, None)
        if instance is None or instance.card is None:
            return
        name = instance.card.name
        entry = self.models[name]
        entry.workers.pop(instance_id, None)
        entry.routing.router.remove_worker(instance_id)
        self.metrics.workers.set(self.worker_count)
        log.info("worker %s of %s is gone", instance_id, name)
        if not entry.workers:
            del self.models[name]
            await entry.routing.close()
            log.info("model %s has no workers left", name)

    async def close(self) -> None:
        for entry in list(self.models.values()):
            await entry.routing.close()
        self.models.clear()
        self._workers.clear()

    def _fetcher(self, model: str) -> Callable[[str], Awaitable[KvSnapshot]]:
        async def fetch_snapshot(worker_id: str) -> KvSnapshot:
            entry = self.models.get(model)
            client = entry.workers.get(worker_id) if entry is not None else None
            if client is None:
                raise RemoteError("unavailable", f"worker {worker_id} of {model} is gone", retryable=True)
            return await client.kv_snapshot()

        return fetch_snapshot

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

    async def _new_model(self, card: ModelCard, client: WorkerClient) -> ModelEntry:
        preprocessor, max_chars = await self._preprocessor(card, client)
        fetch = self._fetcher(card.name)
        routing = await build_router(self.config, card, self.events, fetch, self.metrics.router)
        metrics = self.metrics.for_model(card.name)
        return ModelEntry(card.name, card, routing, metrics, preprocessor, max_chars)
