"""Discovery: who is alive, where, serving what.

A backend only has to provide a small key-value store under one namespace (`put`, `get`,
`get_prefix`, `delete`, `watch_prefix`); instance registration is built on top of it here, once.

Keys are relative to the namespace root: `instances/worker/w1` is stored as
`weir/<namespace>/instances/worker/w1` in etcd. Layout (see `keys.py`):

    instances/<component>/<instance_id>   msgpack Instance, leased
    drain/<instance_id>                   written by `weir drain`: asks the instance to drain
    drained/<instance_id>                 written by the instance once drained, leased

A leased key lives as long as the process that wrote it keeps its lease alive (TTL `ttl`
seconds): a process that dies disappears from every watcher within the TTL.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

import msgspec

from orchestrator.runtime.discovery.keys import instance_key, instances_prefix
from orchestrator.runtime.protocol import Instance

DEFAULT_TTL = 10.0

_encode_instance = msgspec.msgpack.Encoder().encode
_decode_instance = msgspec.msgpack.Decoder(Instance).decode


class DiscoveryUnavailable(ConnectionError):
    """The backend cannot be reached right now (watches keep their last state and retry)."""


@dataclass(frozen=True, slots=True)
class KeyEvent:
    """A change under a watched prefix. `value` is None for a delete."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes | None


@dataclass(frozen=True, slots=True)
class DiscoveryEvent:
    """An instance appeared or changed (`put`) or went away (`delete`, with its last known value)."""

    kind: Literal["put", "delete"]
    instance: Instance


class Discovery(ABC):
    def __init__(self, namespace: str, ttl: float = DEFAULT_TTL) -> None:
        self.namespace = namespace
        self.ttl = ttl

    # ------------------------------------------------------------------ key-value primitives

    @abstractmethod
    async def put(self, key: str, value: bytes, leased: bool = False) -> None:
        """Store `value`; a leased key is removed when this process's lease ends."""

    @abstractmethod
    async def get(self, key: str) -> bytes | None: ...

    @abstractmethod
    async def get_prefix(self, prefix: str) -> dict[str, bytes]: ...

    @abstractmethod
    async def delete(self, key: str) -> None: ...

    @abstractmethod
    def watch_prefix(self, prefix: str) -> AsyncIterator[KeyEvent]:
        """Every key under `prefix`: first a `put` per existing key, then changes as they happen.
        Writing a key again with the value it has is no change and is not reported.

        The stream survives backend reconnects; after one it re-reads the prefix and reports
        only the differences, so a consumer never sees a key vanish just because the backend
        was unreachable."""

    @abstractmethod
    async def close(self) -> None:
        """Stop keep-alives and watches; leased keys of this process go away."""

    # ------------------------------------------------------------------ instances

    async def register(self, instance: Instance) -> None:
        """Announce `instance` under a lease; registering the same id again updates it."""
        key = instance_key(instance.component, instance.instance_id)
        await self.put(key, _encode_instance(instance), leased=True)

    async def deregister(self, instance_id: str) -> None:
        for key in await self.get_prefix(instances_prefix()):
            if key.rsplit("/", 1)[-1] == instance_id:
                await self.delete(key)

    async def list(self, component: str) -> list[Instance]:
        found = await self.get_prefix(instances_prefix(component))
        return [inst for value in found.values() if (inst := _decode_or_none(value)) is not None]

    async def watch(self, component: str) -> AsyncIterator[DiscoveryEvent]:
        """Instances of `component`: the current ones first (as puts), then changes."""
        known: dict[str, Instance] = {}
        async for event in self.watch_prefix(instances_prefix(component)):
            if event.kind == "put":
                assert event.value is not None
                instance = _decode_or_none(event.value)
                if instance is None:
                    continue
                known[event.key] = instance
                yield DiscoveryEvent("put", instance)
            elif (gone := known.pop(event.key, None)) is not None:
                yield DiscoveryEvent("delete", gone)


def _decode_or_none(value: bytes) -> Instance | None:
    # A newer or broken peer must not take down every watcher: skip what does not decode.
    try:
        return _decode_instance(value)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
