"""The KV data plane: WorkerHosts on real request-plane sockets, a prefill host holding
FakeEngine records and a decode host pulling them (shared memory, TCP, and Mooncake's transfer
engine as the fabric between hosts), expiry, a killed
prefill process, refused records, the cluster secret, and /dev/shm left clean."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import msgspec
import pytest
from prometheus_client import REGISTRY

from orchestrator.runtime import kv_transfer_server
from orchestrator.runtime.discovery import Discovery
from orchestrator.runtime.engine import ArrivingKv
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.events import EventPlane
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.kv_fabric import KvFabric, make_fabric
from orchestrator.runtime.kv_mooncake import MooncakeFabric
from orchestrator.runtime.kv_transfer import (
    INLINE,
    SHM_DIR,
    KvBlocksCall,
    KvPushed,
    KvShared,
    decode_answer,
    host_id,
    segment_name,
)
from orchestrator.runtime.kv_transfer_client import pull_kv
from orchestrator.runtime.protocol import KvTransfer, TokenDelta, WorkerRequest
from orchestrator.runtime.request_plane import (
    KV_BLOCKS,
    PlaneSecurity,
    RequestPlaneClient,
    RequestPlaneServer,
    TcpWorkerClient,
)
from orchestrator.runtime.worker_host import WorkerHost
from tests.runtime.fake_engine import BLOCK_SIZE, FakeEngine, fake_record
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]
SECRET = b"k" * 32
PROMPT = list(range(1, 4 * BLOCK_SIZE + 3))  # 4 full blocks and a partial one


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob("weir-kv-*")}


@pytest.fixture(autouse=True)
async def no_segment_left() -> AsyncIterator[None]:
    before = segments()
    yield
    await eventually(lambda: segments() <= before)


async def started(
    planes: tuple[Discovery, EventPlane], name: str, engine: FakeEngine | None = None, **kwargs: object
) -> WorkerHost:
    host = WorkerHost(engine or FakeEngine(), *planes, namespace="test", instance_id=name, **kwargs)  # type: ignore[arg-type]
    await host.start()
    return host


async def collect(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [delta async for delta in stream]


async def prefill(host: WorkerHost, request_id: str = "p") -> KvTransfer:
    deltas = await collect(
        host.generate(WorkerRequest(request_id=request_id, token_ids=PROMPT, max_tokens=8, prefill_only=True))
    )
    transfer = deltas[-1].kv_transfer
    assert transfer is not None
    return transfer


def decode_request(transfer: KvTransfer, request_id: str = "d") -> WorkerRequest:
    return WorkerRequest(
        request_id=request_id,
        token_ids=PROMPT,
        max_tokens=3,
        kv_transfer=transfer,
        generated_token_ids=[len(PROMPT)],
    )


def expected_records(record_bytes: int) -> list[bytes]:
    return [fake_record(h, record_bytes) for h in block_hashes(PROMPT, BLOCK_SIZE)]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_a_decode_gets_exactly_the_prefills_records(
    planes: tuple[Discovery, EventPlane], transport: str
) -> None:
    # 1 MiB records: several answer frames and shared-memory batches per transfer.
    p = await started(planes, f"p-{transport}", FakeEngine(record_bytes=1 << 20))
    d = await started(planes, f"d-{transport}")
    client = RequestPlaneClient()
    try:
        [last] = await collect(
            TcpWorkerClient(client, p.address).generate(
                WorkerRequest(request_id="p", token_ids=PROMPT, max_tokens=8, prefill_only=True)
            )
        )
        transfer = last.kv_transfer
        assert transfer is not None and p.kv.holds(transfer.transfer_id)
        assert (transfer.source_worker, transfer.address, transfer.host_id) == (
            p.instance_id,
            p.address,
            host_id(),
        )
        if transport == "tcp":
            transfer.host_id = "another-machine"
        deltas = await collect(TcpWorkerClient(client, d.address).generate(decode_request(transfer)))
        assert deltas[-1].finish_reason == "length"
        assert isinstance(d.engine, FakeEngine) and isinstance(p.engine, FakeEngine)
        assert d.engine.arrived["d"] == expected_records(1 << 20)
        # Served once, then released.
        await eventually(lambda: not p.kv.holds(transfer.transfer_id))
        assert p.engine.released == [transfer.transfer_id]
        size = 4 << 20
        assert (
            metric(
                "weir_worker_kv_transfer_bytes_total",
                worker=d.instance_id,
                direction="pulled",
                transport=transport,
            )
            == size
        )
        assert (
            metric("weir_worker_kv_transfers_total", worker=p.instance_id, direction="served", outcome="ok")
            == 1
        )
        assert (
            metric("weir_worker_kv_transfers_total", worker=d.instance_id, direction="pulled", outcome="ok")
            == 1
        )
        # A second pull of the same transfer finds nothing (and does not raise).
        assert await pull_kv(client, transfer, 5) == []
    finally:
        await client.close()
        await d.stop()
        await p.stop()


async def test_in_process_hosts_pull_through_generate(planes: tuple[Discovery, EventPlane]) -> None:
    """`weir serve` calls `host.generate` directly: the same path pulls."""
    p, d = await started(planes, "p-inproc"), await started(planes, "d-inproc")
    try:
        transfer = await prefill(p)
        plain = await collect(d.generate(WorkerRequest(request_id="plain", token_ids=PROMPT, max_tokens=2)))
        assert plain[-1].finish_reason == "length"
        await collect(d.generate(decode_request(transfer)))
        assert isinstance(d.engine, FakeEngine)
        assert "plain" not in d.engine.arrived and d.engine.arrived["d"] == expected_records(256)
    finally:
        await d.stop()
        await p.stop()


class Recomputing(FakeEngine):
    """An engine that cannot load KV, as the vLLM, SGLang and TensorRT-LLM adapters: it never
    awaits `arriving_kv`."""

    def generate(
        self, request: WorkerRequest, arriving_kv: ArrivingKv | None = None
    ) -> AsyncIterator[TokenDelta]:
        return super().generate(request)


async def test_an_engine_that_cannot_load_kv_starts_no_pull(planes: tuple[Discovery, EventPlane]) -> None:
    p, d = await started(planes, "p-unloaded"), await started(planes, "d-unloaded", Recomputing())
    try:
        transfer = await prefill(p)
        deltas = await collect(d.generate(decode_request(transfer)))
        assert deltas[-1].finish_reason == "length"
        assert p.kv.holds(transfer.transfer_id)  # nobody asked for it: it waits for its expiry
        assert (
            metric("weir_worker_kv_transfers_total", worker=d.instance_id, direction="pulled", outcome="ok")
            == 0
        )
    finally:
        await d.stop()
        await p.stop()


async def test_an_unpulled_transfer_is_released_at_expiry(planes: tuple[Discovery, EventPlane]) -> None:
    p = await started(planes, "p-expiry", kv_hold_s=0.05)
    d = await started(planes, "d-expiry")
    try:
        transfer = await prefill(p)
        assert isinstance(p.engine, FakeEngine)
        await eventually(lambda: p.engine.released == [transfer.transfer_id])  # type: ignore[union-attr]
        assert (
            metric(
                "weir_worker_kv_transfers_total", worker=p.instance_id, direction="served", outcome="expired"
            )
            == 1
        )
        # The decode still runs: nothing arrived, so the engine computes the whole prompt.
        deltas = await collect(d.generate(decode_request(transfer)))
        assert deltas[-1].finish_reason == "length"
        assert isinstance(d.engine, FakeEngine) and d.engine.arrived["d"] == []
        assert (
            metric(
                "weir_worker_kv_transfers_total", worker=d.instance_id, direction="pulled", outcome="failed"
            )
            == 1
        )
    finally:
        await d.stop()
        await p.stop()


async def test_an_unclaimed_segment_is_removed_at_expiry(planes: tuple[Discovery, EventPlane]) -> None:
    """A caller that asked for shared memory and vanished before reading leaks nothing."""
    p = await started(planes, "p-segment", kv_hold_s=0.2)
    client = RequestPlaneClient()
    try:
        transfer = await prefill(p)
        call = msgspec.msgpack.encode(KvBlocksCall(transfer.transfer_id, host_id(), segment_name()))
        stream = client.stream(p.address, KV_BLOCKS, call)
        answer = decode_answer(await anext(stream))
        await stream.aclose()
        assert isinstance(answer, KvShared) and (SHM_DIR / answer.segment).exists()
        await eventually(lambda: not (SHM_DIR / answer.segment).exists())
        assert isinstance(p.engine, FakeEngine) and p.engine.released == [transfer.transfer_id]
    finally:
        await client.close()
        await p.stop()


# A prefill worker that sends two of four records, then waits to be SIGKILLed mid-transfer:
# inline over TCP, or written through a fabric (the caller's buffer named in its call).
KILLED_WORKER = """
import asyncio, msgspec
from orchestrator.runtime.kv_fabric import make_fabric
from orchestrator.runtime.kv_transfer import INLINE, KvBlocksCall, KvPushed
from orchestrator.runtime.request_plane import KV_BLOCKS, RequestPlaneServer
from tests.runtime.fake_engine import fake_record

TRANSPORT = {transport!r}
fabric = make_fabric("mooncake", "127.0.0.1") if TRANSPORT == "mooncake" else None

async def kv_blocks(payload):
    records = [fake_record(1, 4096), fake_record(2, 4096)]
    if fabric is None:
        yield INLINE
        for record in records:
            yield record
    else:
        call = msgspec.msgpack.decode(payload, type=KvBlocksCall)
        await asyncio.to_thread(fabric.write, call.fabric, records, call.buffer)
        yield msgspec.msgpack.encode(KvPushed(0, [4096, 4096]))
    await asyncio.sleep(0)  # the frame is flushed on the next loop iteration
    await asyncio.sleep(0)
    print("sent", flush=True)
    await asyncio.Event().wait()  # SIGKILLed here, mid-transfer

async def main():
    server = RequestPlaneServer({{KV_BLOCKS: kv_blocks}})
    print(await server.start("127.0.0.1", 0), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.parametrize("transport", ["tcp", "mooncake"])
async def test_a_prefill_worker_killed_mid_transfer_leaves_the_prefix_that_arrived(
    transport: str, request: pytest.FixtureRequest
) -> None:
    fabric: KvFabric | None = request.getfixturevalue("fabrics")[1] if transport == "mooncake" else None
    script = KILLED_WORKER.format(transport=transport)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    client = RequestPlaneClient()
    worker = f"killed-{transport}"
    try:
        assert proc.stdout is not None
        port = int(await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30))
        transfer = KvTransfer(
            transfer_id="t", address=f"127.0.0.1:{port}", block_hashes=[1, 2, 3, 4], block_bytes=4096
        )
        pull = asyncio.create_task(pull_kv(client, transfer, 30, worker_id=worker, fabric=fabric))
        assert await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30) == "sent\n"
        os.kill(proc.pid, signal.SIGKILL)
        assert await asyncio.wait_for(pull, 10) == [fake_record(1, 4096), fake_record(2, 4096)]
        labels = {"worker": worker, "direction": "pulled"}
        assert metric("weir_worker_kv_transfers_total", **labels, outcome="partial") == 1
        assert metric("weir_worker_kv_transfer_bytes_total", **labels, transport=transport) == 8192
    finally:
        proc.kill()
        proc.wait()
        await client.close()


DIES_AFTER_CREATING = """
import asyncio, os, msgspec
from orchestrator.runtime.kv_transfer import KvBlocksCall, new_segment
from orchestrator.runtime.request_plane import KV_BLOCKS, RequestPlaneServer

async def kv_blocks(payload):
    call = msgspec.msgpack.decode(payload, type=KvBlocksCall)
    os.write(new_segment(call.segment), b"x" * 4096)
    print("created", flush=True)
    await asyncio.Event().wait()  # SIGKILLed here: the segment made, nothing said of it
    yield b""

async def main():
    server = RequestPlaneServer({KV_BLOCKS: kv_blocks})
    print(await server.start("127.0.0.1", 0), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_segment_left_by_a_server_that_died_is_removed_by_the_caller() -> None:
    """The caller names the segment, so a server killed between creating it and announcing it
    leaks nothing: the caller removes it when its pull ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", DIES_AFTER_CREATING], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    client = RequestPlaneClient()
    before = set(SHM_DIR.glob("weir-kv-*"))
    try:
        assert proc.stdout is not None
        port = int(await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30))
        transfer = KvTransfer(
            transfer_id="t",
            address=f"127.0.0.1:{port}",
            host_id=host_id(),
            block_hashes=[1, 2],
            block_bytes=4096,
        )
        pull = asyncio.create_task(pull_kv(client, transfer, 30, worker_id="dies"))
        assert await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30) == "created\n"
        [made] = set(SHM_DIR.glob("weir-kv-*")) - before
        os.kill(proc.pid, signal.SIGKILL)
        assert await asyncio.wait_for(pull, 10) == []
        assert not made.exists()
    finally:
        proc.kill()
        proc.wait()
        await client.close()


async def answering(frames: list[bytes]) -> RequestPlaneServer:
    async def kv_blocks(payload: bytes) -> AsyncGenerator[bytes, None]:
        for frame in frames:
            yield frame

    server = RequestPlaneServer({KV_BLOCKS: kv_blocks})
    await server.start()
    return server


GOOD = [b"a" * 100, b"b" * 100, b"c" * 100]
SHARED_1GIB = msgspec.msgpack.encode(KvShared("weir-kv-" + "0" * 32, 0, [1 << 30]))


@pytest.mark.parametrize(
    ("answer", "kept", "reason"),
    [
        ([INLINE, *GOOD[:2], b"x" * 5000], 2, "oversized"),
        ([INLINE, *GOOD, b"d" * 100], 3, "surplus"),
        # Declared sizes are checked before the segment is opened or read.
        ([SHARED_1GIB], 0, "oversized"),
    ],
)
async def test_oversized_and_surplus_records_are_refused(answer: list[bytes], kept: int, reason: str) -> None:
    server = await answering(answer)
    client = RequestPlaneClient()
    worker = f"refusing-{reason}-{kept}"
    try:
        transfer = KvTransfer(
            transfer_id="t", address=f"127.0.0.1:{server.port}", block_hashes=[1, 2, 3], block_bytes=100
        )
        assert await pull_kv(client, transfer, 5, worker_id=worker) == GOOD[:kept]
        assert metric("weir_worker_kv_records_refused_total", worker=worker, reason=reason) == 1
    finally:
        await client.close()
        await server.stop()


@pytest.mark.parametrize(
    "answer",
    [
        KvShared("../../etc/passwd", 0, [10]),  # a segment name outside the pattern
        KvPushed(0, [10]),  # a fabric buffer, where the pull offered none
    ],
)
async def test_an_answer_naming_memory_the_pull_did_not_offer_is_never_read(
    answer: KvShared | KvPushed,
) -> None:
    server = await answering([msgspec.msgpack.encode(answer)])
    client = RequestPlaneClient()
    try:
        transfer = KvTransfer(
            transfer_id="t", address=f"127.0.0.1:{server.port}", block_hashes=[1], block_bytes=100
        )
        assert await pull_kv(client, transfer, 5) == []
    finally:
        await client.close()
        await server.stop()


async def test_with_a_cluster_secret_only_members_pull(planes: tuple[Discovery, EventPlane]) -> None:
    security = PlaneSecurity(secret=SECRET)
    p = await started(planes, "p-secret", security=security)
    d = await started(planes, "d-secret", security=security)
    stranger = RequestPlaneClient()
    try:
        transfer = await prefill(p)
        assert await pull_kv(stranger, transfer, 5) == []
        assert p.kv.holds(transfer.transfer_id)  # the call never reached the server
        await collect(d.generate(decode_request(transfer)))
        assert isinstance(d.engine, FakeEngine) and d.engine.arrived["d"] == expected_records(256)
    finally:
        await stranger.close()
        await d.stop()
        await p.stop()


async def test_cancelling_the_decode_stops_the_pull(planes: tuple[Discovery, EventPlane]) -> None:
    first_sent, closed = asyncio.Event(), asyncio.Event()

    async def kv_blocks(payload: bytes) -> AsyncGenerator[bytes, None]:
        try:
            yield INLINE
            yield b"a" * 100
            first_sent.set()
            await asyncio.Event().wait()
        finally:
            closed.set()

    server = RequestPlaneServer({KV_BLOCKS: kv_blocks})
    await server.start()
    d = await started(planes, "d-cancel")
    try:
        transfer = KvTransfer(
            transfer_id="t", address=f"127.0.0.1:{server.port}", block_hashes=[1, 2], block_bytes=100
        )
        decode = asyncio.create_task(collect(d.generate(decode_request(transfer))))
        await asyncio.wait_for(first_sent.wait(), 5)
        decode.cancel()
        await asyncio.wait_for(closed.wait(), 5)
        assert d.in_flight == 0
    finally:
        await d.stop()
        await server.stop()


async def test_a_transfer_naming_other_blocks_is_refused_on_the_wire(
    planes: tuple[Discovery, EventPlane],
) -> None:
    d = await started(planes, "d-forged")
    client = RequestPlaneClient()
    try:
        forged = KvTransfer(transfer_id="t", address=d.address, block_hashes=[1, 2], block_bytes=100)
        with pytest.raises(EngineError) as refused:
            await collect(TcpWorkerClient(client, d.address).generate(decode_request(forged)))
        assert refused.value.code == "invalid_request"
    finally:
        await client.close()
        await d.stop()


# ---------------------------------------------------------------- a transfer engine's fabric


@pytest.fixture(scope="module")
def fabrics(mooncake: None) -> tuple[KvFabric, KvFabric]:
    """Two Mooncake transfer engines on loopback, one per side, as two hosts would run."""
    return make_fabric("mooncake", "127.0.0.1"), make_fabric("mooncake", "127.0.0.1")


async def test_a_decode_on_another_host_gets_the_records_through_the_fabric(
    planes: tuple[Discovery, EventPlane], fabrics: tuple[KvFabric, KvFabric], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_transfer_server, "FABRIC_BATCH_BYTES", 1 << 20)  # a write per record
    p = await started(planes, "p-fabric", FakeEngine(record_bytes=1 << 20), kv_fabric=fabrics[0])
    d = await started(planes, "d-fabric", kv_fabric=fabrics[1])
    try:
        transfer = await prefill(p)
        transfer.host_id = "another-machine"
        deltas = await collect(d.generate(decode_request(transfer)))
        assert deltas[-1].finish_reason == "length"
        assert isinstance(d.engine, FakeEngine) and d.engine.arrived["d"] == expected_records(1 << 20)
        await eventually(lambda: not p.kv.holds(transfer.transfer_id))
        for worker, direction in ((d.instance_id, "pulled"), (p.instance_id, "served")):
            labels = {"worker": worker, "direction": direction}
            assert metric("weir_worker_kv_transfer_bytes_total", **labels, transport="mooncake") == 4 << 20
            assert metric("weir_worker_kv_transfer_bytes_total", **labels, transport="tcp") == 0
            assert metric("weir_worker_kv_transfers_total", **labels, outcome="ok") == 1
    finally:
        await d.stop()
        await p.stop()


async def test_a_prefill_without_a_fabric_answers_a_fabric_caller_over_tcp(
    planes: tuple[Discovery, EventPlane], fabrics: tuple[KvFabric, KvFabric]
) -> None:
    p = await started(planes, "p-nofabric")
    d = await started(planes, "d-nofabric", kv_fabric=fabrics[1])
    try:
        transfer = await prefill(p)
        transfer.host_id = "another-machine"
        await collect(d.generate(decode_request(transfer)))
        assert isinstance(d.engine, FakeEngine) and d.engine.arrived["d"] == expected_records(256)
        labels = {"worker": d.instance_id, "direction": "pulled"}
        assert metric("weir_worker_kv_transfer_bytes_total", **labels, transport="tcp") == 4 * 256
    finally:
        await d.stop()
        await p.stop()


async def test_a_fabric_write_that_fails_sends_the_records_over_tcp(
    planes: tuple[Discovery, EventPlane], fabrics: tuple[KvFabric, KvFabric]
) -> None:
    """A caller whose fabric cannot be reached (here: nobody listens at its session) still
    gets every record, on the request plane's stream."""
    p = await started(planes, "p-unreachable", kv_fabric=fabrics[0])
    client = RequestPlaneClient()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: the fabric's connect is refused
    try:
        transfer = await prefill(p)
        session = f"mooncake:127.0.0.1:{closed.getsockname()[1]}"
        call = KvBlocksCall(transfer.transfer_id, fabric=session, buffer=1 << 20, capacity=1 << 20)
        frames = [frame async for frame in client.stream(p.address, KV_BLOCKS, msgspec.msgpack.encode(call))]
        assert frames == [INLINE, *expected_records(256)]
    finally:
        closed.close()
        await client.close()
        await p.stop()


@pytest.mark.parametrize(
    ("answer", "kept"),
    [
        ([msgspec.msgpack.encode(KvPushed(100, [100]))], 0),  # not where the buffer starts
        ([msgspec.msgpack.encode(KvPushed(0, [100])), msgspec.msgpack.encode(KvPushed(0, [100]))], 1),
        ([msgspec.msgpack.encode(KvPushed(0, [100, 100, 100])), INLINE, b"d" * 100], 3),
    ],
)
async def test_fabric_answers_must_fill_the_buffer_in_order(
    answer: list[bytes], kept: int, fabrics: tuple[KvFabric, KvFabric]
) -> None:
    server = await answering(answer)
    client = RequestPlaneClient()
    try:
        transfer = KvTransfer(
            transfer_id="t", address=f"127.0.0.1:{server.port}", block_hashes=[1, 2, 3], block_bytes=100
        )
        assert len(await pull_kv(client, transfer, 5, fabric=fabrics[1])) == kept
    finally:
        await client.close()
        await server.stop()


def test_receive_buffers_are_pieces_of_one_registered_arena_back_when_their_records_go(
    mooncake: None,
) -> None:
    fabric = MooncakeFabric("127.0.0.1", arena_bytes=1 << 20)
    total = fabric.arena.free_bytes
    first, second = fabric.receive_buffer(100_000), fabric.receive_buffer(200_000)
    assert first.address == fabric.arena.address and second.address > first.address
    records = [first.view[:10], second.view[:10]]
    first.close(complete=True)
    second.close(complete=True)
    del first, second
    gc.collect()
    assert fabric.arena.free_bytes < total  # the records still use their pieces
    records.clear()
    gc.collect()
    assert fabric.arena.free_bytes == total
    # The two pieces merged back: one buffer may now take nearly all of it.
    whole = fabric.receive_buffer(total)
    assert whole.address == fabric.arena.address
    # A pull that ended before its answer did: its piece stays taken, a write may still land.
    whole.close(complete=False)
    del whole
    gc.collect()
    assert fabric.arena.free_bytes == 0
    # With no room in the arena, a buffer of its own, registered for the pull.
    own = fabric.receive_buffer(4096)
    assert not fabric.arena.address <= own.address < fabric.arena.address + total
    own.close(complete=True)


async def test_a_pull_larger_than_the_arena_gets_memory_of_its_own(
    planes: tuple[Discovery, EventPlane], fabrics: tuple[KvFabric, KvFabric]
) -> None:
    small = MooncakeFabric("127.0.0.1", arena_bytes=1 << 20)
    p = await started(planes, "p-big", FakeEngine(record_bytes=1 << 20), kv_fabric=fabrics[0])
    d = await started(planes, "d-big", kv_fabric=small)
    try:
        transfer = await prefill(p)
        transfer.host_id = "another-machine"
        await collect(d.generate(decode_request(transfer)))
        assert isinstance(d.engine, FakeEngine) and d.engine.arrived["d"] == expected_records(1 << 20)
        labels = {"worker": d.instance_id, "direction": "pulled"}
        assert metric("weir_worker_kv_transfer_bytes_total", **labels, transport="mooncake") == 4 << 20
    finally:
        await d.stop()
        await p.stop()
