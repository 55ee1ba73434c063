"""The worker side of the request plane: one task per open stream, many per connection.

A handler takes the call's payload and returns an async iterator of response payloads.
Raising `EngineError` sends that error; any other exception becomes an `internal` error.
A `Cancel` frame, or the connection closing, cancels the handler's task; the handler's
iterator is then closed, so whatever it holds (an engine request, KV blocks) is freed.

A connection over `max_connections`, or over `max_connections_per_peer` from one IP, is closed
at once; with a cluster secret, no frame is read before the caller passed the handshake
(security.py). Both are `PlaneSecurity` settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import AsyncGenerator, Callable

from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import ErrorCode, WorkerError
from orchestrator.runtime.request_plane.connection import FrameProtocol
from orchestrator.runtime.request_plane.frames import Call, Cancel, Data, End, Error, Frame, stream_id_of
from orchestrator.runtime.request_plane.security import (
    MAC_BYTES,
    NONCE_BYTES,
    PlaneSecurity,
    caller_proof,
    matches,
    new_nonce,
    server_proof,
)
from orchestrator.runtime.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)

# An async generator function: the server closes what it returns, so a handler's cleanup runs
# whether the stream ended, failed or was cancelled.
Handler = Callable[[bytes], AsyncGenerator[bytes, None]]


class _ServerConnection(FrameProtocol):
    def __init__(self, server: RequestPlaneServer) -> None:
        super().__init__(server.security.max_frame_bytes)
        self._handlers = server.handlers
        self._server = server
        self.warn = server.warn  # one throttle for the server: a flood of bad peers logs a little
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self._nonce = b""
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        server, security = self._server, self._server.security
        peer = self.peer
        if len(server.connections) >= security.max_connections:
            self.refuse(f"over {security.max_connections} connections")
            return
        if server.per_peer.get(peer, 0) >= security.max_connections_per_peer:
            self.refuse(f"over {security.max_connections_per_peer} connections from one peer")
            return
        server.connections.add(self)
        server.per_peer[peer] = server.per_peer.get(peer, 0) + 1
        if security.secret is not None:
            self._nonce = new_nonce()
            assert self.transport is not None
            self.transport.write(self._nonce)
            self.expect_raw(MAC_BYTES + NONCE_BYTES)
            self._deadline = self.loop.call_later(security.handshake_timeout, self._too_slow)

    def _too_slow(self) -> None:
        self.refuse("no handshake answer in time")

    def raw_received(self, data: bytes) -> None:
        secret = self._server.security.secret
        assert secret is not None and self.transport is not None
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        proof, caller_nonce = data[:MAC_BYTES], data[MAC_BYTES:]
        if not matches(caller_proof(secret, self._nonce), proof):
            self.refuse("a caller failed the cluster-secret handshake")
            return
        self.transport.write(server_proof(secret, caller_nonce, self._nonce))

    def connection_lost(self, exc: Exception | None) -> None:
        peer = self.peer  # before the transport is gone
        super().connection_lost(exc)
        if self._deadline is not None:
            self._deadline.cancel()
        if self in self._server.connections:
            self._server.connections.discard(self)
            left = self._server.per_peer.pop(peer, 1) - 1
            if left:
                self._server.per_peer[peer] = left
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()

    def frame_received(self, frame: Frame) -> None:
        if type(frame) is Call:
            self._open(frame)
        elif type(frame) is Cancel:
            task = self.tasks.pop(frame.stream_id, None)
            if task is not None:
                task.cancel()
        else:
            self.warn(f"request plane: unexpected {type(frame).__name__} frame from a caller")

    def malformed_frame(self, raw: bytes, exc: Exception) -> None:
        super().malformed_frame(raw, exc)
        stream_id = stream_id_of(raw)
        if stream_id is not None and stream_id not in self.tasks:
            self._fail(stream_id, "invalid_request", f"malformed frame: {exc}")

    def _open(self, call: Call) -> None:
        handler = self._handlers.get(call.endpoint)
        if handler is None:
            self._fail(call.stream_id, "invalid_request", f"unknown endpoint {call.endpoint!r}")
        elif call.stream_id in self.tasks:
            self._fail(call.stream_id, "invalid_request", f"stream {call.stream_id} is already open")
        else:
            task = self.loop.create_task(self._serve(call.stream_id, handler, call.payload))
            self.tasks[call.stream_id] = task

    def _fail(self, stream_id: int, code: ErrorCode, message: str) -> None:
        self.send(Error(stream_id, WorkerError(code=code, message=message)))

    async def _serve(self, stream_id: int, handler: Handler, payload: bytes) -> None:
        stream: AsyncGenerator[bytes, None] | None = None
        try:
            stream = handler(payload)
            async for chunk in stream:
                self.send(Data(stream_id, chunk))
                if self.paused:
                    await self.writable()
            self.send(End(stream_id))
        except EngineError as exc:
            self.send(Error(stream_id, exc.to_wire()))
        except Exception as exc:
            log.exception("request plane: handler failed on stream %d", stream_id)
            self.send(Error(stream_id, WorkerError(code="internal", message=repr(exc))))
        finally:
            self.tasks.pop(stream_id, None)
            if stream is not None:
                await stream.aclose()


class RequestPlaneServer:
    def __init__(self, handlers: dict[str, Handler], security: PlaneSecurity | None = None) -> None:
        self.handlers = handlers
        self.security = security or PlaneSecurity()
        self.connections: set[_ServerConnection] = set()
        self.per_peer: dict[str, int] = {}
        self.warn = ThrottledWarning(log)
        self.host = ""
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen; returns the bound port (port 0 picks a free one)."""
        loop = asyncio.get_running_loop()
        tls = self.security.server_tls
        self._server = await loop.create_server(
            lambda: _ServerConnection(self),
            host,
            port,
            ssl=tls,
            ssl_handshake_timeout=self.security.handshake_timeout if tls is not None else None,
        )
        if self.security.secret is None and not _is_loopback(host):
            log.warning(
                "request plane on %s:%s takes calls from anyone: set a cluster secret "
                "(--cluster-secret or WEIR_CLUSTER_SECRET) on every weir process",
                host,
                self._server.sockets[0].getsockname()[1],
            )
        self.host = host
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        """Stop listening and close every connection; open streams are cancelled."""
        if self._server is None:
            return
        self._server.close()
        tasks = [task for conn in self.connections for task in conn.tasks.values()]
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        for task in tasks:
            task.cancel()
        # Let the handlers run their cleanup (an engine frees the requests) before returning.
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._server.wait_closed()
        self._server = None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, or a wildcard ("" binds every address)
        return False


def dial_address(host: str, port: int, advertise_host: str | None = None) -> str:
    """The "host:port" others dial for a server bound to `host` (`advertised_host`)."""
    advertise_host = advertised_host(host, advertise_host)
    return f"[{advertise_host}]:{port}" if ":" in advertise_host else f"{advertise_host}:{port}"


def advertised_host(host: str, advertise_host: str | None = None) -> str:
    """The host others dial for a server bound to `host`: `advertise_host` if given; a
    wildcard bind address is no use to them, so this host's own address stands in."""
    if advertise_host:
        return advertise_host
    wildcard = host in ("", "0.0.0.0", "::")
    return socket.gethostbyname(socket.gethostname()) if wildcard else host
