"""The seam between the runtime and a token engine.

A backend (DeepInfer, the mocker, a vLLM adapter, ...) implements `Engine`; the runtime's
worker host (`orchestrator.runtime.worker_host`) serves it on the request plane, registers
its model card in discovery and publishes its KV events and load reports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Protocol

from orchestrator.runtime.protocol import (
    KvEventBatch,
    KvSnapshot,
    LoadReport,
    ModelCard,
    TokenDelta,
    WorkerRequest,
)

# The records a decode worker's host pulls for a request with `kv_transfer` (kvbm records, in
# `block_hashes` order, possibly fewer than asked: a pull that failed midway), once awaited.
ArrivingKv = Awaitable[Sequence[bytes | memoryview]]


class DeltaStream(Protocol):
    """One request's deltas. `aclose()` before the end cancels the request and frees its KV
    blocks at once; an async generator of TokenDeltas is one. Failures arrive as
    `orchestrator.runtime.errors.EngineError`."""

    def __aiter__(self) -> AsyncIterator[TokenDelta]: ...

    async def __anext__(self) -> TokenDelta: ...

    async def aclose(self) -> None: ...


class Engine(Protocol):
    """What every backend provides to the worker host. All methods run on the host's event loop."""

    @property
    def card(self) -> ModelCard: ...

    async def start(self) -> None:
        """Load weights, allocate KV memory, start the step loop."""

    async def stop(self) -> None:
        """Stop the loop; in-flight requests end with finish_reason 'abort'."""

    def generate(self, request: WorkerRequest, arriving_kv: ArrivingKv | None = None) -> DeltaStream:
        """Stream deltas for one request; the last has a finish_reason and usage. A request
        the engine rejects or cannot finish raises EngineError.

        Disaggregation: a `prefill_only` request ends after its first token, and its last delta
        carries a `KvTransfer` naming the blocks the engine now holds (until
        `release_transfer`). `arriving_kv`, for a request with `kv_transfer`, is the pull of
        those blocks' records from the prefill worker, not started: an engine that can load
        them queues the request as waiting for its KV, then awaits it, loads the records of
        its layout that check out as prefix hits and computes the rest. One that cannot
        leaves it unawaited, and no pull runs (its host closes it)."""
        ...

    def read_transfer(self, transfer_id: str) -> list[bytes] | None:
        """The records of the blocks held for `transfer_id`, in order; None if none are held
        (unknown, released or never offered). Called off the event loop: it may copy."""
        ...

    def release_transfer(self, transfer_id: str) -> None:
        """Free the blocks held for `transfer_id` (pulled, or given up on); unknown ids are a no-op."""
        ...

    def load(self) -> LoadReport:
        """Current load; `worker_id` is filled in by the host."""
        ...

    def take_kv_events(self) -> list[KvEventBatch]:
        """Drain KV event batches produced since the last call (ids assigned by the engine,
        monotonic from 1; `worker_id` filled in by the host)."""
        ...

    def kv_snapshot(self) -> KvSnapshot:
        """Every cached block, as of the last event batch returned by take_kv_events."""
        ...
