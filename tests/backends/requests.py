"""Helpers of the adapter tests: a WorkerRequest (three prompt tokens, ten to generate, and
whatever fields a test sets), and a wait for an engine's KV events to name given blocks."""

from __future__ import annotations

from collections.abc import Iterable

from orchestrator.runtime.engine import Engine
from orchestrator.runtime.protocol import BlockStored, WorkerRequest
from tests.waiting import eventually


def request(**kw: object) -> WorkerRequest:
    fields: dict[str, object] = {"request_id": "r1", "token_ids": [5, 6, 7], "max_tokens": 10}
    fields.update(kw)
    return WorkerRequest(**fields)  # type: ignore[arg-type]


async def wait_stored(worker: Engine, hashes: Iterable[int], timeout: float = 10.0) -> None:
    """Until the worker's KV events have stored every block of `hashes` (Weir's hashes)."""
    wanted, seen = set(hashes), set[int]()

    def stored() -> bool:
        for batch in worker.take_kv_events():
            seen.update(h for e in batch.events if isinstance(e, BlockStored) for h in e.blocks)
        return wanted <= seen

    await eventually(stored, timeout)
