"""The closed request plane over real loopback TCP: frame and connection limits, the
cluster-secret handshake, TLS. Each test runs on asyncio's loop and on uvloop (conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.request_plane import PlaneSecurity, RequestPlaneClient, RequestPlaneServer
from orchestrator.runtime.request_plane.frames import Call, encode_frame
from orchestrator.runtime.request_plane.security import (
    MAC_BYTES,
    NONCE_BYTES,
    caller_proof,
    client_tls_context,
    server_tls_context,
)
from tests.certs import make_certs
from tests.waiting import eventually

SECRET = b"s3cret-s3cret-s3cret"


class Echo:
    """Answers each call with its payload and counts the calls it saw."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, payload: bytes) -> AsyncIterator[bytes]:
        self.calls += 1
        yield payload


async def started(security: PlaneSecurity) -> tuple[RequestPlaneServer, Echo]:
    echo = Echo()
    server = RequestPlaneServer({"echo": echo}, security)
    await server.start("127.0.0.1", 0)
    return server, echo


async def call(client: RequestPlaneClient, server: RequestPlaneServer, payload: bytes = b"hi") -> list[bytes]:
    return [chunk async for chunk in client.stream(f"127.0.0.1:{server.port}", "echo", payload)]


async def closed_by_peer(reader: asyncio.StreamReader, timeout: float = 5.0) -> bool:
    """True when the server closes the connection (EOF or reset) before `timeout`."""
    try:
        while await asyncio.wait_for(reader.read(65536), timeout):
            pass
    except (ConnectionError, TimeoutError) as exc:
        return not isinstance(exc, TimeoutError)
    return True


async def test_an_oversized_frame_header_closes_the_connection_before_its_body() -> None:
    server, _echo = await started(PlaneSecurity(max_frame_bytes=1024))
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write((64 * 1024 * 1024).to_bytes(4, "big"))
    assert await closed_by_peer(reader)
    await eventually(lambda: not server.connections and not server.per_peer)
    # A frame within the limit still works on a new connection.
    client = RequestPlaneClient()
    assert await call(client, server, b"x" * 900) == [b"x" * 900]
    await client.close()
    await server.stop()


async def test_a_large_frame_arriving_in_small_pieces_is_reassembled() -> None:
    server, echo = await started(PlaneSecurity())
    payload = bytes(range(256)) * (3 * 1024 * 1024 // 256)
    frame = encode_frame(Call(1, "echo", payload))
    _reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    for start in range(0, len(frame), 1000):
        writer.write(frame[start : start + 1000])
        await writer.drain()
    await eventually(lambda: echo.calls == 1)
    writer.close()
    await server.stop()


async def test_connections_over_the_per_peer_cap_are_refused_at_once_others_are_served() -> None:
    server, _echo = await started(PlaneSecurity(max_connections_per_peer=2))
    first = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
    await eventually(lambda: len(server.connections) == 2)
    reader, _ = await asyncio.open_connection("127.0.0.1", server.port)
    assert await closed_by_peer(reader)
    # Another peer (Linux answers all of 127/8 on loopback) still gets in.
    _, other = await asyncio.open_connection("127.0.0.1", server.port, local_addr=("127.0.0.2", 0))
    await eventually(lambda: server.per_peer == {"127.0.0.1": 2, "127.0.0.2": 1})
    for _, writer in [*first]:
        writer.close()
    other.close()
    await eventually(lambda: not server.connections and not server.per_peer)
    client = RequestPlaneClient()  # the slots came back
    assert await call(client, server) == [b"hi"]
    await client.close()
    await server.stop()


async def test_connections_over_the_total_cap_are_refused_at_once() -> None:
    server, _echo = await started(PlaneSecurity(max_connections=2))
    held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
    await eventually(lambda: len(server.connections) == 2)
    reader, _ = await asyncio.open_connection("127.0.0.1", server.port, local_addr=("127.0.0.3", 0))
    assert await closed_by_peer(reader)
    for _, writer in held:
        writer.close()
    await server.stop()


async def test_with_a_secret_the_right_secret_is_served() -> None:
    server, _echo = await started(PlaneSecurity(secret=SECRET))
    client = RequestPlaneClient(security=PlaneSecurity(secret=SECRET))
    assert await call(client, server) == [b"hi"]
    assert await call(client, server) == [b"hi"]  # the pooled connection stays authenticated
    await client.close()
    await server.stop()


@pytest.mark.parametrize("secret", [None, b"another-secret-of-16+"])
async def test_a_caller_without_the_secret_is_refused_and_runs_nothing(secret: bytes | None) -> None:
    server, echo = await started(PlaneSecurity(secret=SECRET))
    client = RequestPlaneClient(connect_timeout=2.0, security=PlaneSecurity(secret=secret))
    with pytest.raises(EngineError) as refused:
        await call(client, server)
    assert refused.value.code == "unavailable"
    await eventually(lambda: not server.connections)
    assert echo.calls == 0
    await client.close()
    await server.stop()


async def test_frames_sent_before_the_handshake_are_never_processed() -> None:
    server, echo = await started(PlaneSecurity(secret=SECRET))
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    nonce = await reader.readexactly(NONCE_BYTES)
    # Call frames where the answer belongs: taken as a (wrong) answer, then the connection goes.
    writer.write(encode_frame(Call(1, "echo", b"x" * 80)) * 4)
    assert await closed_by_peer(reader)
    assert echo.calls == 0
    # The right answer, computed from the nonce, passes.
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    nonce = await reader.readexactly(NONCE_BYTES)
    writer.write(caller_proof(SECRET, nonce) + bytes(NONCE_BYTES) + encode_frame(Call(1, "echo", b"ok")))
    assert len(await reader.readexactly(MAC_BYTES)) == MAC_BYTES
    await eventually(lambda: echo.calls == 1)
    writer.close()
    await server.stop()


async def test_a_connection_that_does_not_answer_the_handshake_is_closed() -> None:
    server, _echo = await started(PlaneSecurity(secret=SECRET, handshake_timeout=0.3))
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    await reader.readexactly(NONCE_BYTES)
    assert await closed_by_peer(reader)
    await eventually(lambda: not server.connections)
    writer.close()
    await server.stop()


async def test_a_caller_with_a_secret_does_not_call_a_server_without_one() -> None:
    server, echo = await started(PlaneSecurity())
    client = RequestPlaneClient(connect_timeout=0.5, security=PlaneSecurity(secret=SECRET))
    with pytest.raises(EngineError) as refused:
        await call(client, server)
    assert refused.value.code == "unavailable"
    assert echo.calls == 0
    await client.close()
    await server.stop()


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        PlaneSecurity(secret=b"short")


async def test_tls_with_a_secret_serves_callers_that_trust_the_ca(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    tls = server_tls_context(str(certs.cert), str(certs.key))
    server, echo = await started(PlaneSecurity(secret=SECRET, server_tls=tls))
    trusting = PlaneSecurity(secret=SECRET, client_tls=client_tls_context(str(certs.ca)))
    client = RequestPlaneClient(security=trusting)
    assert await call(client, server) == [b"hi"]
    await client.close()
    plain = RequestPlaneClient(connect_timeout=1.0, security=PlaneSecurity(secret=SECRET))
    with pytest.raises(EngineError):
        await call(plain, server)
    await plain.close()
    (tmp_path / "other").mkdir()
    other_ca = make_certs(tmp_path / "other")
    distrusting = PlaneSecurity(secret=SECRET, client_tls=client_tls_context(str(other_ca.ca)))
    stranger = RequestPlaneClient(connect_timeout=1.0, security=distrusting)
    with pytest.raises(EngineError):
        await call(stranger, server)
    await stranger.close()
    assert echo.calls == 1
    await server.stop()
