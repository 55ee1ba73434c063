"""WorkerHost over the real request plane, with in-process and real etcd/NATS planes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

import httpx
import msgspec
import pytest
from prometheus_client import REGISTRY

from orchestrator.runtime.discovery import Discovery, KeyEvent, drain_key, drained_key, make_discovery
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.events import EventPlane, Subscription, make_event_plane
from orchestrator.runtime.health import HealthServer
from orchestrator.runtime.protocol import KvEventBatch, LoadReport, TokenDelta, WorkerRequest, subject
from orchestrator.runtime.request_plane import (
    RequestPlaneClient,
    TcpWorkerClient,
)
from orchestrator.runtime.worker_host import WorkerHost
from tests.runtime.fake_engine import FakeEngine
from tests.waiting import eventually

T = TypeVar("T")


def request(request_id: str, max_tokens: int = 4, prompt: list[int] | None = None) -> WorkerRequest:
    token_ids = [7, 8, 9] if prompt is None else prompt
    return WorkerRequest(request_id=request_id, token_ids=token_ids, max_tokens=max_tokens)


async def collect(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [delta async for delta in stream]


async def receive(sub: Subscription, kind: type[T]) -> T:
    return msgspec.msgpack.decode(await asyncio.wait_for(anext(sub), 3), type=kind)


def kv_events_published(worker: str) -> float:
    value = REGISTRY.get_sample_value("weir_worker_kv_events_published_total", {"worker": worker})
    return value or 0.0


@pytest.fixture
async def host(planes: tuple[Discovery, EventPlane]) -> AsyncIterator[WorkerHost]:
    h = WorkerHost(FakeEngine(step_s=0.001), *planes, namespace="test", instance_id="w1")
    await h.start()
    yield h
    await h.stop()


async def test_generate_over_tcp_from_the_discovered_address(
    host: WorkerHost, planes: tuple[Discovery, EventPlane]
) -> None:
    [instance] = await planes[0].list("worker")
    assert instance.instance_id == "w1" and instance.card is not None and instance.card.name == "fake-model"
    client = RequestPlaneClient()
    deltas = await collect(TcpWorkerClient(client, instance.address).generate(request("r1")))
    # Frames that arrive together merge into one delta: how many there are depends on timing.
    assert [t for d in deltas for t in d.token_ids] == [3, 4, 5, 6]
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage is not None
    assert deltas[-1].usage.completion_tokens == 4
    await client.close()


async def test_engine_errors_and_bad_payloads_are_typed(host: WorkerHost) -> None:
    client = RequestPlaneClient()
    with pytest.raises(EngineError) as rejected:
        await collect(TcpWorkerClient(client, host.address).generate(request("r1", prompt=[])))
    assert (rejected.value.code, rejected.value.message) == ("invalid_request", "empty prompt")
    with pytest.raises(EngineError) as garbage:
        async for _ in client.stream(host.address, "generate", msgspec.msgpack.encode({"nonsense": 1})):
            pass
    assert garbage.value.code == "invalid_request" and not garbage.value.retryable
    await client.close()


async def test_closing_the_stream_cancels_the_engine_request(host: WorkerHost) -> None:
    engine = host.engine
    assert isinstance(engine, FakeEngine)
    client = RequestPlaneClient()
    stream = TcpWorkerClient(client, host.address).generate(request("long", max_tokens=10_000))
    assert (await anext(stream)).token_ids == [3]
    await stream.aclose()
    await eventually(lambda: "long" in engine.cancelled)
    assert engine.cancelled == ["long"] and not engine.active and host.in_flight == 0
    await client.close()


async def test_frames_that_arrived_together_come_out_as_one_delta(host: WorkerHost) -> None:
    client = RequestPlaneClient()
    worker = TcpWorkerClient(client, host.address)
    stream = worker.generate(request("burst", max_tokens=20))
    first = await anext(stream)
    assert first.token_ids == [3]
    await eventually(lambda: host.in_flight == 0)  # the worker finishes while we do not read
    # A later answer on the same connection comes after the frames already sent: once it is
    # here, so are they.
    await worker.kv_snapshot()
    rest = await collect(stream)
    assert len(rest) == 1
    assert rest[0].token_ids == list(range(4, 23))
    assert rest[0].finish_reason == "length"
    assert rest[0].usage is not None and rest[0].usage.completion_tokens == 20
    await client.close()


async def test_model_files_sends_the_tokenizer_files_and_no_weights(
    planes: tuple[Discovery, EventPlane], tmp_path: Path
) -> None:
    sent = {"tokenizer.json": b'{"model": {}}', "tokenizer_config.json": b"{}", "config.json": b"{}"}
    for name, content in {**sent, "model.safetensors": b"weights", "vocab.txt": b"a"}.items():
        (tmp_path / name).write_bytes(content)
    engine = FakeEngine(model_path=str(tmp_path))
    h = WorkerHost(engine, *planes, namespace="test", instance_id="files")
    await h.start()
    client = RequestPlaneClient()
    try:
        assert (await TcpWorkerClient(client, h.address).model_files()).files == sent
        assert (await h.model_files()).files == sent  # in-process callers (weir serve)
    finally:
        await client.close()
        await h.stop()


async def test_model_files_without_a_model_path_is_empty(host: WorkerHost) -> None:
    client = RequestPlaneClient()
    assert (await TcpWorkerClient(client, host.address).model_files()).files == {}
    await client.close()


async def test_kv_events_load_and_snapshot(host: WorkerHost, planes: tuple[Discovery, EventPlane]) -> None:
    events = planes[1]
    published_before = kv_events_published("w1")
    kv = await events.subscribe(subject("test", "fake-model", "kv"))
    load = await events.subscribe(subject("test", "fake-model", "load"))
    client = RequestPlaneClient()
    worker = TcpWorkerClient(client, host.address)
    await collect(worker.generate(request("a", prompt=[11, 1])))
    await collect(worker.generate(request("b", prompt=[22, 1])))

    batches = [await receive(kv, KvEventBatch) for _ in range(2)]
    assert [(b.worker_id, b.event_id) for b in batches] == [("w1", 1), ("w1", 2)]
    assert [b.events[0].blocks for b in batches] == [[11], [22]]  # type: ignore[union-attr]
    sent = sum(len(b.events) for b in batches)
    await eventually(lambda: kv_events_published("w1") - published_before == sent)
    report = await receive(load, LoadReport)
    assert report.worker_id == "w1" and report.total_blocks == 100

    snapshot = await worker.kv_snapshot()
    assert (snapshot.worker_id, snapshot.event_id, snapshot.blocks) == ("w1", 2, {"device": [11, 22]})
    # Load reports name the last KV batch taken, so a lost final batch shows as a gap.
    for _ in range(50):
        if report.kv_event_id == 2:
            break
        report = await receive(load, LoadReport)
    assert report.kv_event_id == 2
    await client.close()


async def test_load_is_republished_every_second_without_changes(
    host: WorkerHost, planes: tuple[Discovery, EventPlane]
) -> None:
    load = await planes[1].subscribe(subject("test", "fake-model", "load"))
    first = await asyncio.wait_for(anext(load), 2.5)
    second = await asyncio.wait_for(anext(load), 2.5)
    assert first == second  # nothing changed, yet a heartbeat came


async def test_the_host_serves_in_process_callers_like_remote_ones(
    planes: tuple[Discovery, EventPlane],
) -> None:
    engine = FakeEngine()
    local = WorkerHost(engine, *planes, namespace="test", instance_id="local")
    await local.start()
    try:
        assert [d.token_ids for d in await collect(local.generate(request("r", 2)))] == [[3], [4]]
        with pytest.raises(EngineError) as rejected:
            await collect(local.generate(request("bad", prompt=[])))
        assert rejected.value.code == "invalid_request"
        stream = local.generate(request("long", max_tokens=100))
        await anext(stream)
        assert local.in_flight == 1
        await stream.aclose()
        assert engine.cancelled == ["long"] and local.in_flight == 0
        assert (await local.kv_snapshot()).worker_id == "local"
        outcomes = {
            o: REGISTRY.get_sample_value("weir_worker_requests_total", {"worker": "local", "outcome": o})
            for o in ("ok", "error", "cancelled")
        }
        assert outcomes == {"ok": 1.0, "error": 1.0, "cancelled": 1.0}

        await local.drain()  # a draining host refuses in-process callers too
        with pytest.raises(EngineError) as refused:
            await collect(local.generate(request("late")))
        assert (refused.value.code, refused.value.retryable) == ("overloaded", True)
    finally:
        await local.stop()


async def test_drain_over_real_etcd_and_nats(etcd_url: str, nats_url: str) -> None:
    namespace = f"drain{uuid.uuid4().hex[:6]}"
    discovery, events = make_discovery(etcd_url, namespace, ttl=2), make_event_plane(nats_url)
    operator = make_discovery(etcd_url, namespace)
    host = WorkerHost(FakeEngine(step_s=0.01), discovery, events, namespace, instance_id="w1")
    client = RequestPlaneClient()
    try:
        await host.start()
        worker = TcpWorkerClient(client, host.address)
        load = await events.subscribe(subject(namespace, "fake-model", "load"))
        watch = operator.watch("worker")
        assert not (await asyncio.wait_for(anext(watch), 5)).instance.draining

        in_flight = asyncio.create_task(collect(worker.generate(request("slow", max_tokens=50))))
        await eventually(lambda: host.in_flight == 1)
        await operator.put(drain_key("w1"), b"")  # what `weir drain` writes
        update = await asyncio.wait_for(anext(watch), 5)
        assert update.kind == "put" and update.instance.draining

        with pytest.raises(EngineError) as refused:
            await collect(worker.generate(request("late")))
        assert (refused.value.code, refused.value.retryable) == ("overloaded", True)
        assert await operator.get(drained_key("w1")) is None, "not drained while a request runs"

        deltas = await asyncio.wait_for(in_flight, 10)
        assert len(deltas) == 50 and deltas[-1].finish_reason == "length"
        drained = operator.watch_prefix(drained_key("w1"))
        assert await asyncio.wait_for(anext(drained), 5) == KeyEvent("put", drained_key("w1"), b"")
        await drained.aclose()  # type: ignore[attr-defined]
        reports = [await receive(load, LoadReport) for _ in range(2)]
        assert any(r.draining for r in reports)
    finally:
        await client.close()
        await host.stop()
        await discovery.close()
        await events.close()
    assert await operator.list("worker") == []
    assert await operator.get(drain_key("w1")) is None, "a stopped worker clears its drain request"
    await operator.close()


async def test_health_endpoint() -> None:
    ready = False
    server = HealthServer(lambda: ready)
    port = await server.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.get("/live")).status_code == 200
            assert (await http.get("/health")).status_code == 503
            ready = True
            assert (await http.get("/health")).status_code == 200
            metrics = await http.get("/metrics")
            assert metrics.status_code == 200 and "weir_worker_requests" in metrics.text
            assert (await http.get("/nope")).status_code == 404
            assert (await http.post("/live")).status_code == 405
    finally:
        await server.stop()
