"""A test double for `Engine`: deterministic tokens, a delay per step, and a record of what
happened (started, stopped, cancelled requests). Real engines live in backends/."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import (
    BlockStored,
    KvEventBatch,
    KvSnapshot,
    LoadReport,
    ModelCard,
    TokenDelta,
    Usage,
    WorkerRequest,
)


class FakeEngine:
    """Request i streams tokens prompt_len, prompt_len+1, ... one per `step_s`. Each request
    stores one KV block named by its first prompt token; `token_ids=[]` is rejected."""

    def __init__(self, name: str = "fake-model", step_s: float = 0.0, model_path: str | None = None) -> None:
        self._card = ModelCard(name=name, model_path=model_path, block_size=4, total_kv_blocks=100)
        self.step_s = step_s
        self.started = False
        self.stopped = False
        self.active: set[str] = set()
        self.cancelled: list[str] = []
        self._event_id = 0
        self._pending: list[KvEventBatch] = []
        self._blocks: list[int] = []

    @property
    def card(self) -> ModelCard:
        return self._card

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def generate(self, request: WorkerRequest) -> AsyncIterator[TokenDelta]:
        if not request.token_ids:
            raise EngineError("invalid_request", "empty prompt")
        self.active.add(request.request_id)
        self._store(request.token_ids[0])
        finished = False
        try:
            n = len(request.token_ids)
            for i in range(request.max_tokens):
                await asyncio.sleep(self.step_s)
                if i == request.max_tokens - 1:
                    finished = True
                    usage = Usage(prompt_tokens=n, completion_tokens=request.max_tokens)
                    yield TokenDelta(token_ids=[n + i], finish_reason="length", usage=usage)
                else:
                    yield TokenDelta(token_ids=[n + i])
        finally:
            self.active.discard(request.request_id)
            if not finished:
                self.cancelled.append(request.request_id)

    def load(self) -> LoadReport:
        return LoadReport(worker_id="", active_requests=len(self.active), total_blocks=100)

    def take_kv_events(self) -> list[KvEventBatch]:
        batches, self._pending = self._pending, []
        return batches

    def kv_snapshot(self) -> KvSnapshot:
        return KvSnapshot(worker_id="", event_id=self._event_id, blocks={"device": list(self._blocks)})

    def _store(self, block: int) -> None:
        self._event_id += 1
        self._blocks.append(block)
        batch = KvEventBatch(worker_id="", event_id=self._event_id, events=[BlockStored(blocks=[block])])
        self._pending.append(batch)
