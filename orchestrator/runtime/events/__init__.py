"""Event plane: KV events and load reports, worker to routers. `make_event_plane` picks the backend."""

from __future__ import annotations

from orchestrator.runtime.events.base import EventPlane, Subscription, subject_matches
from orchestrator.runtime.events.memory import MemoryEventPlane


def make_event_plane(url: str | None) -> EventPlane:
    """None or "memory": in-process. Otherwise a NATS URL such as nats://127.0.0.1:4222.
    Nothing connects until first use."""
    if url is None or url == "memory":
        return MemoryEventPlane()
    from orchestrator.runtime.events.nats import NatsEventPlane

    return NatsEventPlane(url)


__all__ = ["EventPlane", "MemoryEventPlane", "Subscription", "make_event_plane", "subject_matches"]
