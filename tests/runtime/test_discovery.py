"""Discovery on the in-process backend and on a real etcd: replay, changes, leases, SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from orchestrator.runtime.discovery import (
    Discovery,
    DiscoveryEvent,
    KeyEvent,
    MemoryDiscovery,
    drain_key,
    make_discovery,
)
from orchestrator.runtime.protocol import Instance, ModelCard


def worker(instance_id: str, address: str = "127.0.0.1:1") -> Instance:
    return Instance(instance_id=instance_id, component="worker", address=address, card=ModelCard(name="m"))


async def next_event(events: AsyncIterator[DiscoveryEvent], timeout: float = 5.0) -> DiscoveryEvent:
    return await asyncio.wait_for(anext(events), timeout)


@pytest.fixture(params=["memory", "etcd"])
async def discovery(request: pytest.FixtureRequest) -> AsyncIterator[Discovery]:
    namespace = f"t{uuid.uuid4().hex[:8]}"
    url = None if request.param == "memory" else request.getfixturevalue("etcd_url")
    d = make_discovery(url, namespace, ttl=2)
    yield d
    await d.close()


async def test_watch_replays_current_instances_then_changes(discovery: Discovery) -> None:
    await discovery.register(worker("a"))
    await discovery.register(worker("b"))
    events = discovery.watch("worker")
    replay = {(await next_event(events)).instance.instance_id for _ in range(2)}
    assert replay == {"a", "b"}

    await discovery.register(worker("c", "127.0.0.1:3"))
    added = await next_event(events)
    assert (added.kind, added.instance.instance_id, added.instance.address) == ("put", "c", "127.0.0.1:3")

    await discovery.deregister("a")
    removed = await next_event(events)
    # A delete carries the last known Instance, so a watcher knows what went away.
    assert (removed.kind, removed.instance.instance_id) == ("delete", "a")
    assert removed.instance.address == "127.0.0.1:1"
    assert sorted(i.instance_id for i in await discovery.list("worker")) == ["b", "c"]
    assert await discovery.list("frontend") == []
    await events.aclose()  # type: ignore[attr-defined]


async def test_reregistering_updates_the_instance(discovery: Discovery) -> None:
    await discovery.register(worker("a"))
    events = discovery.watch("worker")
    assert not (await next_event(events)).instance.draining
    await discovery.register(Instance(instance_id="a", component="worker", draining=True))
    update = await next_event(events)
    assert update.kind == "put" and update.instance.draining
    await events.aclose()  # type: ignore[attr-defined]


async def test_writing_the_same_value_again_is_not_a_change(discovery: Discovery) -> None:
    # etcd emits a PUT for every write; a lease restore writes every key again unchanged.
    keys = discovery.watch_prefix("cfg/")
    await discovery.put("cfg/a", b"1")
    assert await asyncio.wait_for(anext(keys), 5) == KeyEvent("put", "cfg/a", b"1")
    await discovery.put("cfg/a", b"1")
    await discovery.put("cfg/a", b"2")
    # Events come in write order: had the second write been reported, it would come first.
    assert await asyncio.wait_for(anext(keys), 5) == KeyEvent("put", "cfg/a", b"2")
    await keys.aclose()  # type: ignore[attr-defined]

    # The same through registrations, leased as a worker's are.
    await discovery.register(worker("a"))
    events = discovery.watch("worker")
    assert (await next_event(events)).instance.instance_id == "a"
    await discovery.register(worker("a"))
    await discovery.register(worker("b"))
    assert (await next_event(events)).instance.instance_id == "b"
    await events.aclose()  # type: ignore[attr-defined]


async def test_control_keys(discovery: Discovery) -> None:
    keys = discovery.watch_prefix("drain/")
    await discovery.put(drain_key("w1"), b"", leased=False)
    assert await asyncio.wait_for(anext(keys), 5) == KeyEvent("put", "drain/w1", b"")
    assert await discovery.get(drain_key("w1")) == b""
    assert await discovery.get(drain_key("w2")) is None
    await discovery.delete(drain_key("w1"))
    assert await asyncio.wait_for(anext(keys), 5) == KeyEvent("delete", "drain/w1", None)
    await keys.aclose()  # type: ignore[attr-defined]


async def test_namespaces_are_isolated(etcd_url: str) -> None:
    one, two = make_discovery(etcd_url, "iso-one"), make_discovery(etcd_url, "iso-two")
    try:
        await one.register(worker("a"))
        assert await two.list("worker") == []
    finally:
        await one.close()
        await two.close()


async def test_close_removes_leased_keys_at_once(etcd_url: str) -> None:
    owner, observer = make_discovery(etcd_url, "close", ttl=10), make_discovery(etcd_url, "close")
    try:
        await owner.register(worker("leaving"))
        events = observer.watch("worker")
        assert (await next_event(events)).kind == "put"
        started = time.monotonic()
        await owner.close()
        assert (await next_event(events, timeout=3)).kind == "delete"
        assert time.monotonic() - started < 3, "revoked lease, not TTL expiry"
    finally:
        await observer.close()


async def test_memory_close_removes_leased_keys_only() -> None:
    d = MemoryDiscovery()
    await d.register(worker("a"))
    await d.put("config", b"1")
    events = d.watch("worker")
    assert (await next_event(events)).kind == "put"
    await d.close()
    assert (await next_event(events)).kind == "delete"
    assert await d.get("config") == b"1"


REGISTER_AND_HANG = """
import asyncio, sys
from orchestrator.runtime.discovery import make_discovery
from orchestrator.runtime.protocol import Instance

async def main():
    d = make_discovery(sys.argv[1], sys.argv[2], ttl=2)
    await d.register(Instance(instance_id="doomed", component="worker", address="127.0.0.1:9"))
    print("registered", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.slow
async def test_sigkilled_worker_disappears_within_its_ttl(etcd_url: str) -> None:
    namespace = f"kill{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen(
        [sys.executable, "-c", REGISTER_AND_HANG, etcd_url, namespace], stdout=subprocess.PIPE, text=True
    )
    observer = make_discovery(etcd_url, namespace)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        assert line.strip() == "registered"
        events = observer.watch("worker")
        assert (await next_event(events)).instance.instance_id == "doomed"
        # Let a few keep-alives pass: the key must outlive the TTL while the process lives.
        await asyncio.sleep(3)
        assert [i.instance_id for i in await observer.list("worker")] == ["doomed"]

        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        gone = await next_event(events, timeout=10)
        elapsed = time.monotonic() - killed
        assert (gone.kind, gone.instance.instance_id) == ("delete", "doomed")
        assert elapsed < 2 + 1.5, f"lease TTL is 2 s, the delete took {elapsed:.1f} s"
    finally:
        proc.kill()
        proc.wait()
        await observer.close()


async def test_close_ends_open_watches(discovery: Discovery) -> None:
    await discovery.register(worker("a"))
    seen: list[str] = []

    async def follow() -> None:
        async for event in discovery.watch("worker"):
            seen.append(event.instance.instance_id)

    task = asyncio.create_task(follow())
    while not seen:
        await asyncio.sleep(0.01)
    await discovery.close()
    await asyncio.wait_for(task, 5)  # ends, without raising
    assert seen[0] == "a"
