"""In-process event plane for `weir serve`: fan-out to bounded per-subscriber queues."""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from orchestrator.runtime.events.base import EventPlane, Subscription, subject_matches

log = logging.getLogger(__name__)

# Like a NATS slow consumer, a subscriber that falls this far behind loses the oldest messages.
DEFAULT_PENDING_LIMIT = 65_536


class MemorySubscription(Subscription):
    def __init__(self, plane: MemoryEventPlane, pattern: str, limit: int) -> None:
        self.pattern = pattern
        self.dropped = 0
        self._plane = plane
        self._pending: deque[bytes] = deque()
        self._limit = limit
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    def deliver(self, data: bytes) -> None:
        if len(self._pending) >= self._limit:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append(data)
        self._wake()

    async def __anext__(self) -> bytes:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._pending.popleft()

    async def close(self) -> None:
        self._closed = True
        self._plane.unsubscribe(self)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class MemoryEventPlane(EventPlane):
    def __init__(self, pending_limit: int = DEFAULT_PENDING_LIMIT) -> None:
        self._subscriptions: list[MemorySubscription] = []
        self._limit = pending_limit

    async def publish(self, subject: str, data: bytes) -> None:
        for sub in self._subscriptions:
            if subject_matches(sub.pattern, subject):
                sub.deliver(data)

    async def subscribe(self, subject: str) -> Subscription:
        sub = MemorySubscription(self, subject, self._limit)
        self._subscriptions.append(sub)
        return sub

    def unsubscribe(self, sub: MemorySubscription) -> None:
        if sub in self._subscriptions:
            self._subscriptions.remove(sub)

    async def close(self) -> None:
        for sub in list(self._subscriptions):
            await sub.close()
