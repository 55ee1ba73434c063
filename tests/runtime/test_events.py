"""Event plane: in-process and on a real NATS server."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import uuid
from collections.abc import AsyncIterator

import pytest

from orchestrator.runtime.events import EventPlane, MemoryEventPlane, Subscription, make_event_plane
from orchestrator.runtime.events.base import subject_matches
from orchestrator.runtime.protocol import subject
from tests.servers import find_binary, free_port, wait_for_port
from tests.waiting import eventually


@pytest.fixture(params=["memory", "nats"])
async def plane(request: pytest.FixtureRequest) -> AsyncIterator[EventPlane]:
    url = None if request.param == "memory" else request.getfixturevalue("nats_url")
    p = make_event_plane(url)
    yield p
    await p.close()


async def receive(sub: Subscription, n: int) -> list[bytes]:
    return [await asyncio.wait_for(anext(sub), 5) for _ in range(n)]


def unique_namespace() -> str:
    return f"ns{uuid.uuid4().hex[:8]}"


async def test_every_subscriber_gets_every_message_in_order(plane: EventPlane) -> None:
    kv = subject(unique_namespace(), "org/Model-1.5B", "kv")
    subs = [await plane.subscribe(kv) for _ in range(3)]
    messages = [f"m{i}".encode() for i in range(100)]
    for m in messages:
        await plane.publish(kv, m)
    for sub in subs:
        assert await receive(sub, len(messages)) == messages
        await sub.close()


async def test_subjects_are_separate_and_wildcards_match(plane: EventPlane) -> None:
    ns = unique_namespace()
    kv, load = subject(ns, "m", "kv"), subject(ns, "m", "load")
    only_load = await plane.subscribe(load)
    everything = await plane.subscribe(f"weir.{ns}.>")
    any_model_kv = await plane.subscribe(f"weir.{ns}.*.kv")
    await plane.publish(kv, b"k1")
    await plane.publish(load, b"l1")
    assert await receive(only_load, 1) == [b"l1"]
    assert await receive(everything, 2) == [b"k1", b"l1"]
    assert await receive(any_model_kv, 1) == [b"k1"]
    await plane.publish(kv, b"k2")
    assert await receive(any_model_kv, 1) == [b"k2"]
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(only_load), 0.2)


async def test_a_subscription_is_live_when_subscribe_returns(nats_url: str) -> None:
    # Subscriber and publisher on separate connections, as a router and a worker are: only
    # the server's order relates the SUB and the PUB. Repeated, since a miss is a race.
    ns = unique_namespace()
    subscriber, publisher = make_event_plane(nats_url), make_event_plane(nats_url)
    try:
        await publisher.publish(subject(ns, "m", "load"), b"connects the publisher")
        for i in range(50):
            fresh = f"weir.{ns}.m{i}.load"
            sub = await subscriber.subscribe(fresh)
            await publisher.publish(fresh, b"first")
            assert await receive(sub, 1) == [b"first"]
            await sub.close()
    finally:
        await subscriber.close()
        await publisher.close()


async def test_close_ends_iteration(plane: EventPlane) -> None:
    topic = subject(unique_namespace(), "m", "load")
    sub = await plane.subscribe(topic)
    got: list[bytes] = []

    async def drain() -> None:
        async for message in sub:
            got.append(message)

    task = asyncio.create_task(drain())
    await plane.publish(topic, b"one")
    # The consumer appends and, without yielding, waits for the next message: once we see
    # the append, close() ends an iteration in progress.
    await eventually(lambda: got == [b"one"])
    await sub.close()
    await asyncio.wait_for(task, 5)
    assert got == [b"one"]


async def test_slow_memory_subscriber_loses_oldest_messages_not_the_publisher() -> None:
    plane = MemoryEventPlane(pending_limit=10)
    sub = await plane.subscribe("weir.ns.m.kv")
    for i in range(25):
        await plane.publish("weir.ns.m.kv", str(i).encode())
    assert await receive(sub, 10) == [str(i).encode() for i in range(15, 25)]
    assert sub.dropped == 15  # type: ignore[attr-defined]


def test_subject_matching() -> None:
    assert subject_matches("weir.a.m.kv", "weir.a.m.kv")
    assert not subject_matches("weir.a.m.kv", "weir.a.m.load")
    assert subject_matches("weir.a.*.kv", "weir.a.m.kv")
    assert not subject_matches("weir.a.*", "weir.a.m.kv")
    assert subject_matches("weir.>", "weir.a.m.kv")
    assert not subject_matches("weir.a.m.kv.>", "weir.a.m.kv")
    assert subject("my ns", "org/Model-1.5B", "kv") == "weir.my_ns.org_Model-1_5B.kv"


@pytest.mark.slow
async def test_nats_restart_resumes_delivery() -> None:
    binary = find_binary("nats-server", "/usr/sbin/nats-server", "/usr/bin/nats-server")
    assert binary is not None
    port = free_port()

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)], stderr=subprocess.DEVNULL)
        wait_for_port(port, proc=proc)
        return proc

    server = start()
    plane = make_event_plane(f"nats://127.0.0.1:{port}")
    try:
        sub = await plane.subscribe("weir.r.m.load")
        await plane.publish("weir.r.m.load", b"before")
        assert await receive(sub, 1) == [b"before"]
        server.kill()
        server.wait()
        server = start()
        # nats-py reconnects and re-subscribes on its own; publish until delivery resumes.
        for _ in range(100):
            await plane.publish("weir.r.m.load", b"after")
            with contextlib.suppress(TimeoutError):
                if await asyncio.wait_for(anext(sub), 0.1) == b"after":
                    break
        else:
            pytest.fail("no delivery after NATS restarted")
    finally:
        await plane.close()
        server.kill()
        server.wait()
