"""Request plane over real loopback TCP: multiplexing, cancellation, errors, connection loss.

Each test runs on asyncio's loop and on uvloop (see conftest.py)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator

import msgspec
import pytest

from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.request_plane import RequestPlaneClient, RequestPlaneServer
from orchestrator.runtime.request_plane.connection import DIRECT_WRITE_BYTES
from orchestrator.runtime.request_plane.frames import Call, Data, End, Error, decoder, encode_frame


async def count(payload: bytes) -> AsyncIterator[bytes]:
    """Yields payload+0 .. payload+n-1 for payload 'name:n', yielding the loop between items."""
    name, n = payload.decode().split(":")
    for i in range(int(n)):
        await asyncio.sleep(0)
        yield f"{name}:{i}".encode()


class Forever:
    """A handler that streams until cancelled and records that its cleanup ran."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cleaned_up = asyncio.Event()

    async def __call__(self, payload: bytes) -> AsyncIterator[bytes]:
        self.started.set()
        try:
            while True:
                yield b"tick"
                await asyncio.sleep(0.01)
        finally:
            self.cleaned_up.set()


async def fail_after_one(payload: bytes) -> AsyncIterator[bytes]:
    yield b"first"
    if payload == b"typed":
        raise EngineError("overloaded", "draining", retryable=True)
    raise ValueError("boom")


@pytest.fixture
async def server() -> AsyncIterator[RequestPlaneServer]:
    forever = Forever()
    srv = RequestPlaneServer({"count": count, "forever": forever, "fail": fail_after_one})
    srv.forever = forever  # type: ignore[attr-defined]
    await srv.start("127.0.0.1", 0)
    yield srv
    await srv.stop()


def address(srv: RequestPlaneServer) -> str:
    return f"127.0.0.1:{srv.port}"


async def test_200_interleaved_streams_share_one_connection(server: RequestPlaneServer) -> None:
    client = RequestPlaneClient()
    arrivals: list[str] = []

    async def consume(i: int) -> list[bytes]:
        got = []
        async for chunk in client.stream(address(server), "count", f"s{i}:20".encode()):
            arrivals.append(f"s{i}")
            got.append(chunk)
        return got

    results = await asyncio.gather(*(consume(i) for i in range(200)))
    for i, got in enumerate(results):
        assert got == [f"s{i}:{k}".encode() for k in range(20)]
    assert len(server.connections) == 1
    # Interleaved, not one stream after another: the last stream's first item arrives
    # before the first stream's last item.
    assert arrivals.index("s199") < len(arrivals) - 1 - arrivals[::-1].index("s0")
    await client.close()


async def test_drain_ready_takes_what_has_arrived_without_waiting(server: RequestPlaneServer) -> None:
    client = RequestPlaneClient()
    stream = client.stream(address(server), "count", b"d:5")
    assert stream.drain_ready() == []  # not started: nothing sent, nothing arrived
    assert await anext(stream) == b"d:0"
    for _ in range(100):  # let the other four arrive
        if len(stream._inbox.items) == 4:
            break
        await asyncio.sleep(0.01)
    assert stream.drain_ready() == [b"d:1", b"d:2", b"d:3", b"d:4"]
    assert stream.drain_ready() == []
    assert [chunk async for chunk in stream] == []  # then the end of the stream
    await client.close()


async def test_aclose_cancels_the_server_handler(server: RequestPlaneServer) -> None:
    client = RequestPlaneClient()
    stream = client.stream(address(server), "forever", b"")
    assert await stream.__anext__() == b"tick"
    await stream.aclose()
    await asyncio.wait_for(server.forever.cleaned_up.wait(), 2.0)  # type: ignore[attr-defined]
    assert server.connections and not next(iter(server.connections)).tasks
    await client.close()


async def test_breaking_out_of_the_loop_cancels_the_server_handler(server: RequestPlaneServer) -> None:
    client = RequestPlaneClient()
    async for _ in client.stream(address(server), "forever", b""):
        break
    gc.collect()
    await asyncio.wait_for(server.forever.cleaned_up.wait(), 2.0)  # type: ignore[attr-defined]
    await client.close()


async def test_a_caller_that_falls_behind_is_cancelled_after_a_bounded_backlog(
    server: RequestPlaneServer,
) -> None:
    # A consumer that stops reading (a slow HTTP client upstream) while the worker keeps
    # generating: the backlog stops at the bound, the worker's handler is cancelled, and the
    # caller gets what was buffered, then a non-retryable `cancelled`.
    client = RequestPlaneClient(max_backlog_bytes=400)
    stream = client.stream(address(server), "forever", b"")
    assert await stream.__anext__() == b"tick"
    await asyncio.wait_for(server.forever.cleaned_up.wait(), 5.0)  # type: ignore[attr-defined]
    buffered: list[bytes] = []
    with pytest.raises(EngineError) as failed:
        async for payload in stream:
            buffered.append(payload)
    assert 0 < sum(map(len, buffered)) <= 400 and set(buffered) == {b"tick"}
    assert failed.value.code == "cancelled" and not failed.value.retryable
    assert "behind" in failed.value.message
    await client.close()


async def test_cancelling_the_consumer_task_cancels_the_server_handler(server: RequestPlaneServer) -> None:
    client = RequestPlaneClient()

    async def consume() -> None:
        async for _ in client.stream(address(server), "forever", b""):
            pass

    task = asyncio.create_task(consume())
    await asyncio.wait_for(server.forever.started.wait(), 2.0)  # type: ignore[attr-defined]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(server.forever.cleaned_up.wait(), 2.0)  # type: ignore[attr-defined]
    await client.close()


async def test_error_frames_are_typed(server: RequestPlaneServer) -> None:
    client = RequestPlaneClient()
    got: list[bytes] = []
    with pytest.raises(EngineError) as typed:
        async for chunk in client.stream(address(server), "fail", b"typed"):
            got.append(chunk)
    assert got == [b"first"]
    assert (typed.value.code, typed.value.message, typed.value.retryable) == ("overloaded", "draining", True)

    with pytest.raises(EngineError) as internal:
        async for _ in client.stream(address(server), "fail", b"untyped"):
            pass
    assert internal.value.code == "internal" and "boom" in internal.value.message
    assert not internal.value.retryable

    with pytest.raises(EngineError) as unknown:
        async for _ in client.stream(address(server), "nope", b""):
            pass
    assert unknown.value.code == "invalid_request" and "nope" in unknown.value.message
    await client.close()


async def test_connection_loss_is_retryable_and_the_client_reconnects(server: RequestPlaneServer) -> None:
    client = RequestPlaneClient()
    streams = [client.stream(address(server), "forever", b"") for _ in range(5)]
    for stream in streams:
        assert await stream.__anext__() == b"tick"
    port = server.port
    await server.stop()
    for stream in streams:
        with pytest.raises(EngineError) as lost:
            async for _ in stream:
                pass
        assert lost.value.code == "unavailable" and lost.value.retryable

    revived = RequestPlaneServer({"count": count})
    await revived.start("127.0.0.1", port)
    try:
        got = [c async for c in client.stream(f"127.0.0.1:{port}", "count", b"x:3")]
        assert got == [b"x:0", b"x:1", b"x:2"]
    finally:
        await revived.stop()
        await client.close()


async def test_unreachable_worker_is_a_retryable_error(server: RequestPlaneServer) -> None:
    port = server.port
    await server.stop()
    client = RequestPlaneClient()
    with pytest.raises(EngineError) as unreachable:
        async for _ in client.stream(f"127.0.0.1:{port}", "count", b"x:1"):
            pass
    assert unreachable.value.code == "unavailable" and unreachable.value.retryable


async def read_frame(reader: asyncio.StreamReader) -> Data | End | Error:
    size = int.from_bytes(await reader.readexactly(4), "big")
    frame = decoder.decode(await reader.readexactly(size))
    assert isinstance(frame, Data | End | Error)
    return frame


async def test_malformed_frames_do_not_crash_the_server(server: RequestPlaneServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    junk = b"\xc1\xff\x00garbage"
    wrong_types = msgspec.msgpack.encode([1, 7, 12345, "not bytes"])
    unknown_tag = msgspec.msgpack.encode([99, 8])
    for body in (junk, wrong_types, unknown_tag):
        writer.write(len(body).to_bytes(4, "big") + body)
    writer.write(encode_frame(Call(9, "count", b"ok:2")))
    await writer.drain()

    # Frames that decode far enough to name a stream get an error answer; pure junk is dropped.
    frames = [await read_frame(reader) for _ in range(5)]
    errors = {f.stream_id: f.error.code for f in frames if isinstance(f, Error)}
    assert errors == {7: "invalid_request", 8: "invalid_request"}
    assert [f.payload for f in frames if isinstance(f, Data)] == [b"ok:0", b"ok:1"]
    assert isinstance(frames[-1], End) and frames[-1].stream_id == 9

    # A length no frame may have: that connection is dropped, the server keeps serving others.
    writer.write((2**31).to_bytes(4, "big"))
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 2.0) == b""
    writer.close()
    client = RequestPlaneClient()
    assert [c async for c in client.stream(address(server), "count", b"y:1")] == [b"y:0"]
    await client.close()


async def test_a_caller_that_disconnects_cancels_its_handlers(server: RequestPlaneServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(encode_frame(Call(1, "forever", b"")))
    await writer.drain()
    assert isinstance(await read_frame(reader), Data)
    writer.close()
    await asyncio.wait_for(server.forever.cleaned_up.wait(), 2.0)  # type: ignore[attr-defined]


async def test_large_payloads_written_as_is_arrive_intact_and_in_order() -> None:
    """Payloads past DIRECT_WRITE_BYTES skip the write batch; small ones queued before them
    must still leave first, and another stream's frames must not land inside them."""
    big = [bytes([i]) * (DIRECT_WRITE_BYTES + i * 100_003) for i in range(1, 6)]

    async def mixed(payload: bytes) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(big):
            yield f"{payload.decode()}:{i}".encode()
            yield chunk

    srv = RequestPlaneServer({"mixed": mixed})
    await srv.start("127.0.0.1", 0)
    # The call's own backlog bound, not the client's tiny one, applies.
    client = RequestPlaneClient(max_backlog_bytes=400)
    try:

        async def collect(name: str) -> list[bytes]:
            stream = client.stream(
                f"127.0.0.1:{srv.port}", "mixed", name.encode(), max_backlog_bytes=64 << 20
            )
            return [p async for p in stream]

        a, b = await asyncio.gather(collect("a"), collect("b"))
        for name, got in (("a", a), ("b", b)):
            assert got == [x for i, chunk in enumerate(big) for x in (f"{name}:{i}".encode(), chunk)]
    finally:
        await client.close()
        await srv.stop()
