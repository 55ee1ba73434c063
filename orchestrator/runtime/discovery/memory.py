"""In-process discovery for `weir serve`: a dict and a list of watchers, no external service.

Components of one process share a `MemoryDiscovery` instance (whoever creates it closes it).
Leases need no keep-alive here: the store dies with the process, and `close()` removes the
leased keys, as an expired lease would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from orchestrator.runtime.discovery.base import DEFAULT_TTL, Discovery, KeyEvent


class MemoryDiscovery(Discovery):
    def __init__(self, namespace: str = "default", ttl: float = DEFAULT_TTL) -> None:
        super().__init__(namespace, ttl)
        self._data: dict[str, bytes] = {}
        self._leased: set[str] = set()
        self._watchers: list[tuple[str, asyncio.Queue[KeyEvent | None]]] = []

    async def put(self, key: str, value: bytes, leased: bool = False) -> None:
        changed = self._data.get(key) != value
        self._data[key] = value
        if leased:
            self._leased.add(key)
        else:
            self._leased.discard(key)
        if changed:
            self._notify(KeyEvent("put", key, value))

    async def get(self, key: str) -> bytes | None:
        return self._data.get(key)

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return {k: v for k, v in self._data.items() if k.startswith(prefix)}

    async def delete(self, key: str) -> None:
        if self._data.pop(key, None) is not None:
            self._leased.discard(key)
            self._notify(KeyEvent("delete", key, None))

    async def watch_prefix(self, prefix: str) -> AsyncIterator[KeyEvent]:
        queue: asyncio.Queue[KeyEvent | None] = asyncio.Queue()
        # Snapshot and subscribe in one step (no await between), so no change falls in a gap.
        for key, value in list(self._data.items()):
            if key.startswith(prefix):
                queue.put_nowait(KeyEvent("put", key, value))
        entry = (prefix, queue)
        self._watchers.append(entry)
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._watchers.remove(entry)

    async def close(self) -> None:
        for key in list(self._leased):
            await self.delete(key)
        for _, queue in self._watchers:
            queue.put_nowait(None)

    def _notify(self, event: KeyEvent) -> None:
        for prefix, queue in self._watchers:
            if event.key.startswith(prefix):
                queue.put_nowait(event)
