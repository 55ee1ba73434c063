"""A test double for `Engine`: deterministic tokens, a delay per step, and a record of what
happened (started, stopped, cancelled requests, KV transfers). Real engines live in backends/."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from orchestrator.runtime.engine import ArrivingKv
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import (
    BlockStored,
    KvEventBatch,
    KvSnapshot,
    KvTransfer,
    LoadReport,
    ModelCard,
    TokenDelta,
    Usage,
    WorkerRequest,
)

BLOCK_SIZE = 4


def fake_record(block_hash: int, size: int) -> bytes:
    """The record FakeEngine holds for a block: `size` bytes derived from its hash alone."""
    return (block_hash % 2**64).to_bytes(8, "big") * (size // 8) + b"\x5a" * (size % 8)


class FakeEngine:
    """Request i streams tokens prompt_len, prompt_len+1, ... one per `step_s`. Each request
    stores one KV block named by its first prompt token; `token_ids=[]` is rejected.

    Disaggregation: a `prefill_only` request streams one token and offers a transfer of
    `fake_record`s of `record_bytes`, one per full prompt block (none for a prompt under one
    block), held until released. A request with `kv_transfer` awaits its `arriving_kv` and
    records what came."""

    def __init__(
        self,
        name: str = "fake-model",
        step_s: float = 0.0,
        model_path: str | None = None,
        record_bytes: int = 256,
    ) -> None:
        self._card = ModelCard(name=name, model_path=model_path, block_size=BLOCK_SIZE, total_kv_blocks=100)
        self.step_s = step_s
        self.record_bytes = record_bytes
        self.started = False
        self.stopped = False
        self.active: set[str] = set()
        self.cancelled: list[str] = []
        self.held: dict[str, list[bytes]] = {}
        self.released: list[str] = []
        self.arrived: dict[str, list[bytes]] = {}
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

    async def generate(
        self, request: WorkerRequest, arriving_kv: ArrivingKv | None = None
    ) -> AsyncIterator[TokenDelta]:
        if not request.token_ids:
            raise EngineError("invalid_request", "empty prompt")
        if request.kv_transfer is not None and arriving_kv is not None:
            self.arrived[request.request_id] = list(await arriving_kv)
        self.active.add(request.request_id)
        self._store(request.token_ids[0])
        max_tokens = 1 if request.prefill_only else request.max_tokens
        finished = False
        try:
            n = len(request.token_ids)
            for i in range(max_tokens):
                await asyncio.sleep(self.step_s)
                if i == max_tokens - 1:
                    finished = True
                    usage = Usage(prompt_tokens=n, completion_tokens=max_tokens)
                    transfer = self._offer(request) if request.prefill_only else None
                    yield TokenDelta(
                        token_ids=[n + i], finish_reason="length", usage=usage, kv_transfer=transfer
                    )
                else:
                    yield TokenDelta(token_ids=[n + i])
        finally:
            self.active.discard(request.request_id)
            if not finished:
                self.cancelled.append(request.request_id)

    def read_transfer(self, transfer_id: str) -> list[bytes] | None:
        records = self.held.get(transfer_id)
        return None if records is None else list(records)

    def release_transfer(self, transfer_id: str) -> None:
        if self.held.pop(transfer_id, None) is not None:
            self.released.append(transfer_id)

    def load(self) -> LoadReport:
        return LoadReport(worker_id="", active_requests=len(self.active), total_blocks=100)

    def take_kv_events(self) -> list[KvEventBatch]:
        batches, self._pending = self._pending, []
        return batches

    def kv_snapshot(self) -> KvSnapshot:
        return KvSnapshot(worker_id="", event_id=self._event_id, blocks={"device": list(self._blocks)})

    def _offer(self, request: WorkerRequest) -> KvTransfer | None:
        hashes = request.block_hashes or block_hashes(request.token_ids, BLOCK_SIZE, request.cache_salt)
        if not hashes:
            return None
        transfer_id = f"kv-{request.request_id}"
        self.held[transfer_id] = [fake_record(h, self.record_bytes) for h in hashes]
        return KvTransfer(
            transfer_id=transfer_id, block_hashes=hashes, layout=1, block_bytes=self.record_bytes
        )

    def _store(self, block: int) -> None:
        self._event_id += 1
        self._blocks.append(block)
        batch = KvEventBatch(worker_id="", event_id=self._event_id, events=[BlockStored(blocks=[block])])
        self._pending.append(batch)
