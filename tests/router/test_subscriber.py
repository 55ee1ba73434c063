"""RouterSubscriber over real event planes: sync before routing, gap resync, replicas."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest

from orchestrator.runtime.events import EventPlane, MemoryEventPlane, make_event_plane
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import BlockStored, KvEvent, KvEventBatch, KvSnapshot, LoadReport, subject
from router.protocols import InflightUpdate, RouteRequest
from router.router import Router, make_router
from router.subscriber import RouterSubscriber
from tests.waiting import eventually

BS = 4
encode = msgspec.msgpack.encode


class Worker:
    """The publishing side: numbered batches, and a snapshot of everything stored so far."""

    def __init__(self, worker_id: str, plane: EventPlane) -> None:
        self.worker_id = worker_id
        self.plane = plane
        self.event_id = 0
        self.blocks: list[int] = []
        self.snapshots = 0
        self.fail_next = 0

    async def store(self, hashes: list[int], publish: bool = True) -> None:
        self.event_id += 1
        self.blocks += hashes
        events: list[KvEvent] = [BlockStored(blocks=hashes)]
        batch = KvEventBatch(worker_id=self.worker_id, event_id=self.event_id, events=events)
        if publish:  # False: the batch is lost on the way
            await self.plane.publish(subject("ns", "m", "kv"), encode(batch))

    async def snapshot(self) -> KvSnapshot:
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("worker unreachable")
        self.snapshots += 1
        return KvSnapshot(worker_id="", event_id=self.event_id, blocks={"device": list(self.blocks)})


@pytest.fixture(params=["memory", "nats"])
async def plane(request: pytest.FixtureRequest) -> AsyncIterator[EventPlane]:
    """Each event plane replica routers talk over: in-process, and a real NATS server."""
    url = request.getfixturevalue("nats_url") if request.param == "nats" else None
    event_plane = make_event_plane(url)
    yield event_plane
    await event_plane.close()


def kv_router(*workers: Worker) -> Router:
    router = make_router("kv", BS, seed=0)
    for w in workers:
        router.add_worker(w.worker_id)
    return router


def fetcher(*workers: Worker) -> Callable[[str], Awaitable[KvSnapshot]]:
    by_id = {w.worker_id: w for w in workers}
    return lambda worker_id: by_id[worker_id].snapshot()


async def test_restarted_router_syncs_from_snapshots_before_routing() -> None:
    plane = MemoryEventPlane()
    a, b = Worker("a", plane), Worker("b", plane)
    prompt = list(range(64))
    await b.store(block_hashes(prompt, BS), publish=False)  # cached before this router started
    router = kv_router(a, b)
    sub = RouterSubscriber(router, plane, "ns", "m", fetcher(a, b))
    await sub.start()
    try:
        assert router.needs_resync() == []
        # every request for that prefix goes to b from the first one on
        for i in range(3):
            decision = router.select(RouteRequest(f"r{i}", len(prompt), block_hashes(prompt, BS)))
            assert decision.worker_id == "b" and decision.overlap_blocks == 16
            router.on_finish("b", f"r{i}")
    finally:
        await sub.stop()


async def test_gap_triggers_a_resync_and_failed_fetches_are_retried() -> None:
    plane = MemoryEventPlane()
    a = Worker("a", plane)
    router = kv_router(a)
    sub = RouterSubscriber(router, plane, "ns", "m", fetcher(a), retry_s=0.02)
    await sub.start()
    try:
        assert a.snapshots == 1
        await a.store([1, 2])
        await a.store([3], publish=False)  # lost
        a.fail_next = 2
        await a.store([4])  # reveals the gap
        await eventually(lambda: a.snapshots == 2 and router.needs_resync() == [])
        assert router.index is not None
        assert router.index.find_matches([1, 2, 3, 4]).blocks == {"a": 4}
        # a malformed message is dropped, the subscriber keeps going
        await plane.publish(subject("ns", "m", "kv"), b"\xc1 not msgpack")
        await a.store([5])
        index = router.index
        await eventually(lambda: index.find_matches([1, 2, 3, 4, 5]).blocks == {"a": 5})
    finally:
        await sub.stop()


async def test_load_reports_feed_the_router() -> None:
    plane = MemoryEventPlane()
    a = Worker("a", plane)
    router = kv_router(a)
    sub = RouterSubscriber(router, plane, "ns", "m", fetcher(a))
    await sub.start()
    try:
        report = LoadReport(worker_id="a", active_requests=3, active_blocks=40, total_blocks=100)
        await plane.publish(subject("ns", "m", "load"), encode(report))
        await eventually(lambda: router.workers["a"].active_blocks == 40)
        # a report naming a batch the router never saw makes it resync
        await plane.publish(subject("ns", "m", "load"), encode(LoadReport(worker_id="a", kv_event_id=3)))
        await a.store([1])
        await a.store([2], publish=False)
        await a.store([3], publish=False)
        index = router.index
        assert index is not None
        await eventually(lambda: not router.needs_resync() and len(index.find_matches([1, 2, 3]).blocks) == 1)
        assert index.find_matches([1, 2, 3]).blocks == {"a": 3}
        assert a.snapshots >= 2
    finally:
        await sub.stop()


async def test_replicas_share_inflight_load(plane: EventPlane) -> None:
    a = Worker("a", plane)
    one, two = kv_router(a), kv_router(a)
    subs = [RouterSubscriber(r, plane, "ns", "m", fetcher(a)) for r in (one, two)]
    for s in subs:
        await s.start()
    try:
        one.select(RouteRequest("x", 40, block_hashes(list(range(40)), BS)))
        await eventually(lambda: two.workers["a"].inflight_blocks == 10)
        assert two.workers["a"].inflight_requests == 1
        one.on_finish("a", "x")
        await eventually(lambda: two.workers["a"].inflight_requests == 0)
        assert one.workers["a"].inflight_blocks == 0 == two.workers["a"].inflight_blocks
    finally:
        for s in subs:
            await s.stop()


async def test_one_turns_inflight_updates_travel_as_one_message(plane: EventPlane) -> None:
    a = Worker("a", plane)
    one, two = kv_router(a), kv_router(a)
    subs = [RouterSubscriber(r, plane, "ns", "m", fetcher(a)) for r in (one, two)]
    wire = await plane.subscribe(subject("ns", "m", "inflight"))
    for s in subs:
        await s.start()
    try:
        for i in range(3):  # no await between them: one event-loop turn
            one.select(RouteRequest(f"r{i}", 8, block_hashes(list(range(8)), BS)))
        await eventually(lambda: two.workers["a"].inflight_requests == 3)
        message = await anext(aiter(wire))
        assert [u.request_id for u in msgspec.msgpack.decode(message, type=list[InflightUpdate])] == [
            "r0",
            "r1",
            "r2",
        ]
        # What a replica of an earlier version sends, one update per message, still counts.
        legacy = InflightUpdate(router_id="old", worker_id="a", request_id="old-1", blocks=2)
        await plane.publish(subject("ns", "m", "inflight"), encode(legacy))
        await eventually(lambda: two.workers["a"].inflight_requests == 4)
    finally:
        for s in subs:
            await s.stop()
        await wire.close()


def messages_until_heartbeats(router: Router, count: int) -> Callable[[bytes], bool]:
    """A predicate over a `weir.ns.m.*` subscription's messages: true once `count` heartbeats
    of `router` have passed."""
    seen = 0

    def heartbeat_done(data: bytes) -> bool:
        nonlocal seen
        message = msgspec.msgpack.decode(data)
        if isinstance(message, dict) and message.get("router_id") == router.router_id:
            seen += 1
        return seen >= count

    return heartbeat_done


async def test_a_router_alone_publishes_no_inflight_updates(plane: EventPlane) -> None:
    a = Worker("a", plane)
    one = kv_router(a)
    sub = RouterSubscriber(one, plane, "ns", "m", fetcher(a), heartbeat_s=0.05)
    wire = await plane.subscribe("weir.ns.m.*")  # in order: in-flight updates and heartbeats
    await sub.start()
    try:
        one.select(RouteRequest("x", 8, block_hashes(list(range(8)), BS)))
        one.on_finish("a", "x")
        # Two heartbeats after the request: had its updates been queued, they would be out.
        done = messages_until_heartbeats(one, 2)
        kinds = []
        async for data in wire:
            kinds.append(type(msgspec.msgpack.decode(data)).__name__)
            if done(data):
                break
        assert set(kinds) == {"dict"}, kinds  # heartbeats only, no list of updates
        assert one.workers["a"].inflight_requests == 0
    finally:
        await sub.stop()
        await wire.close()


async def test_a_replica_that_joins_late_is_sent_the_load_in_flight(plane: EventPlane) -> None:
    a = Worker("a", plane)
    one, two = kv_router(a), kv_router(a)
    first = RouterSubscriber(one, plane, "ns", "m", fetcher(a), heartbeat_s=0.05)
    second = RouterSubscriber(two, plane, "ns", "m", fetcher(a), heartbeat_s=0.05)
    await first.start()
    try:
        # Two requests sharing 6 of their blocks, routed while `one` is alone: 10 + 4 blocks.
        one.select(RouteRequest("x", 40, block_hashes(list(range(40)), BS)))
        one.select(RouteRequest("y", 40, block_hashes([*range(24), *range(100, 116)], BS)))
        assert one.workers["a"].inflight_blocks == 14
        await second.start()
        await eventually(lambda: two.workers["a"].inflight_requests == 2)
        assert two.workers["a"].inflight_blocks == 14
        one.on_finish("a", "x")
        await eventually(lambda: two.workers["a"].inflight_requests == 1)
        assert two.workers["a"].inflight_blocks == 4  # what `x` counted when it was sent
        # A replica that falls silent (here: stops without finishing its request) is
        # forgotten with what it had in flight.
        two.select(RouteRequest("z", 8, block_hashes(list(range(200, 208)), BS)))
        await eventually(lambda: one.workers["a"].inflight_requests == 2)
        await second.stop()
        await eventually(lambda: one.workers["a"].inflight_requests == 1)
        assert one.workers["a"].inflight_blocks == 10  # `y`'s own, all its blocks now that `x` ended
    finally:
        await first.stop()
        await second.stop()
