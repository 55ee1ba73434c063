"""Discovery: who is alive, where, serving what. `make_discovery` picks the backend."""

from __future__ import annotations

from orchestrator.runtime.discovery.base import (
    DEFAULT_TTL,
    Discovery,
    DiscoveryEvent,
    DiscoveryUnavailable,
    KeyEvent,
)
from orchestrator.runtime.discovery.keys import drain_key, drained_key, instance_key, instances_prefix
from orchestrator.runtime.discovery.memory import MemoryDiscovery


def make_discovery(url: str | None, namespace: str = "default", ttl: float = DEFAULT_TTL) -> Discovery:
    """None or "memory": in-process. Otherwise an etcd URL such as http://127.0.0.1:2379."""
    if url is None or url == "memory":
        return MemoryDiscovery(namespace, ttl)
    from orchestrator.runtime.discovery.etcd import EtcdDiscovery  # grpc loads only when needed

    return EtcdDiscovery(url, namespace, ttl)


__all__ = [
    "DEFAULT_TTL",
    "Discovery",
    "DiscoveryEvent",
    "DiscoveryUnavailable",
    "KeyEvent",
    "MemoryDiscovery",
    "drain_key",
    "drained_key",
    "instance_key",
    "instances_prefix",
    "make_discovery",
]
