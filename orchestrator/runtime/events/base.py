"""The event plane: KV events and load reports from workers to routers, fire-and-forget.

Subjects are dot-separated tokens (`protocol.subject(ns, model, kind)`); a subscription may use
NATS wildcards, `*` for one token and `>` for the rest. Delivery is at most once: a consumer
that falls behind loses messages, which is why KV event batches carry an `event_id` (a router
that sees a gap resyncs from the worker's snapshot).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator


class Subscription(ABC):
    """Messages on one subject, as an async iterator of payloads; ends after `close()`."""

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    @abstractmethod
    async def __anext__(self) -> bytes: ...

    @abstractmethod
    async def close(self) -> None: ...


class EventPlane(ABC):
    @abstractmethod
    async def publish(self, subject: str, data: bytes) -> None: ...

    @abstractmethod
    async def subscribe(self, subject: str) -> Subscription:
        """Messages on `subject` (wildcards allowed). Live on return while the plane is
        reachable: what anyone publishes afterwards is delivered to it."""

    @abstractmethod
    async def close(self) -> None: ...


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` matches one token, a trailing `>` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)
