"""The caller side of the request plane: one pooled connection per worker address.

`stream()` returns a `ResponseStream`, an async iterator of response payloads. Closing it
early (`aclose()`, or dropping it unfinished, or cancelling the task awaiting it) sends a
`Cancel` frame, so the worker stops generating. A lost connection fails every stream open on
it with `EngineError('unavailable', retryable=True)`; the next call reconnects.

A stream's caller that falls behind (a slow HTTP reader upstream) leaves payloads waiting
here; past `max_backlog_bytes` the call is cancelled at the worker and the stream ends, after
what was already buffered, with `EngineError('cancelled')` (not retryable: another worker
would meet the same reader). So a stalled reader costs a bounded number of bytes, not one
payload per generated token. A call may set its own bound (`stream(..., max_backlog_bytes=)`):
a KV pull's frames are megabytes, a delta's are bytes.

With a cluster secret (`PlaneSecurity`), a connection carries no call until the server has
proved it holds the secret too (security.py); a failed or timed-out handshake is `unavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from functools import partial

from orchestrator.runtime.errors import EngineError, unavailable
from orchestrator.runtime.request_plane.connection import FrameProtocol
from orchestrator.runtime.request_plane.frames import Call, Cancel, Data, End, Error, Frame
from orchestrator.runtime.request_plane.security import (
    MAC_BYTES,
    MAX_ANSWER_BYTES,
    NONCE_BYTES,
    PlaneSecurity,
    caller_proof,
    matches,
    new_nonce,
    server_proof,
)


class _ClientConnection(FrameProtocol):
    def __init__(self, address: str, secret: bytes | None) -> None:
        super().__init__(MAX_ANSWER_BYTES)
        self.address = address
        self.streams: dict[int, _Inbox] = {}
        self._next_id = 0
        self._secret = secret
        self._server_nonce = b""
        self._nonce = b""
        # Done once the server is authenticated (at once without a secret).
        self.ready: asyncio.Future[None] = self.loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._secret is None:
            self.ready.set_result(None)
        else:
            self.expect_raw(NONCE_BYTES)

    def raw_received(self, data: bytes) -> None:
        assert self._secret is not None and self.transport is not None
        if not self._server_nonce:
            self._server_nonce, self._nonce = data, new_nonce()
            self.transport.write(caller_proof(self._secret, data) + self._nonce)
            self.expect_raw(MAC_BYTES)
        elif matches(server_proof(self._secret, self._nonce, self._server_nonce), data):
            self.ready.set_result(None)
        else:
            self.ready.set_exception(unavailable(f"{self.address} failed the cluster-secret handshake"))
            self.transport.abort()

    def open_stream(self, inbox: _Inbox, endpoint: str, payload: bytes) -> int:
        self._next_id += 1
        if not self.is_open:  # lost between connecting and this call: nobody would answer
            inbox.finish(unavailable(f"connection to {self.address} lost"))
            return self._next_id
        self.streams[self._next_id] = inbox
        self.send(Call(self._next_id, endpoint, payload))
        return self._next_id

    def cancel_stream(self, stream_id: int) -> None:
        if self.streams.pop(stream_id, None) is not None:
            self.send(Cancel(stream_id))

    def frame_received(self, frame: Frame) -> None:
        # Frames for a stream the caller already cancelled are dropped.
        if type(frame) is Data:
            stream = self.streams.get(frame.stream_id)
            if stream is not None and not stream.push(frame.payload):
                del self.streams[frame.stream_id]
                self.send(Cancel(frame.stream_id))
                stream.finish(
                    EngineError(
                        "cancelled",
                        f"the caller fell more than {stream.max_backlog} bytes behind the stream",
                    )
                )
        elif type(frame) is End:
            stream = self.streams.pop(frame.stream_id, None)
            if stream is not None:
                stream.finish(None)
        elif type(frame) is Error:
            stream = self.streams.pop(frame.stream_id, None)
            if stream is not None:
                stream.finish(EngineError.from_wire(frame.error))
        else:
            self.warn(f"request plane: unexpected {type(frame).__name__} frame from {self.address}")

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self.ready.done():
            # A server that wants a secret we lack (or another one) closes during the handshake.
            self.ready.set_exception(unavailable(f"{self.address} closed the connection in the handshake"))
        streams, self.streams = self.streams, {}
        error = unavailable(f"connection to {self.address} lost" + (f": {exc}" if exc else ""))
        for stream in streams.values():
            stream.finish(error)


class _Inbox:
    """What has arrived for one stream. The connection holds inboxes, never the caller's
    `ResponseStream`, so a stream the caller drops is collected and can cancel itself."""

    __slots__ = ("backlog", "done", "error", "items", "max_backlog", "waiter")

    def __init__(self, max_backlog: int) -> None:
        self.items: deque[bytes] = deque()
        self.backlog = 0  # bytes in `items`
        self.max_backlog = max_backlog
        self.waiter: asyncio.Future[None] | None = None
        self.done = False
        self.error: EngineError | None = None

    def push(self, payload: bytes) -> bool:
        """Queues `payload`; False (payload dropped) when the backlog would pass `max_backlog`."""
        if self.backlog + len(payload) > self.max_backlog and self.items:
            return False
        self.items.append(payload)
        self.backlog += len(payload)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)
        return True

    def pop(self) -> bytes:
        payload = self.items.popleft()
        self.backlog -= len(payload)
        return payload

    def finish(self, error: EngineError | None) -> None:
        self.done = True
        self.error = error
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class ResponseStream:
    """The response payloads of one call. Iterate it; close it if you stop early."""

    __slots__ = ("_client", "_conn", "_inbox", "_request", "_stream_id")

    def __init__(
        self, client: RequestPlaneClient, address: str, endpoint: str, payload: bytes, max_backlog: int
    ) -> None:
        self._client = client
        self._request: tuple[str, str, bytes] | None = (address, endpoint, payload)
        self._conn: _ClientConnection | None = None
        self._stream_id = 0
        self._inbox = _Inbox(max_backlog)

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> bytes:
        if self._request is not None:
            await self._start()
        inbox = self._inbox
        while not inbox.items:
            if inbox.done:
                if inbox.error is not None:
                    raise inbox.error
                raise StopAsyncIteration
            # Not asyncio.get_running_loop(): in 3.11 that is a getpid() syscall per call.
            assert self._conn is not None  # without a connection the inbox is done
            inbox.waiter = self._conn.loop.create_future()
            try:
                await inbox.waiter
            except asyncio.CancelledError:
                self._cancel()
                raise
        return inbox.pop()

    def drain_ready(self) -> list[bytes]:
        """The payloads that have already arrived, without waiting (none before the first
        `__anext__`). Lets a caller handle a burst of frames as one item."""
        items = self._inbox.items
        if not items:
            return []
        ready = list(items)
        items.clear()
        self._inbox.backlog = 0
        return ready

    async def aclose(self) -> None:
        self._cancel()

    def close(self) -> None:
        """`aclose` for callers that are not coroutines: stop the call (a Cancel frame) now."""
        self._cancel()

    def __del__(self) -> None:
        # Dropped unfinished (the caller broke out of its loop): still tell the worker.
        with contextlib.suppress(Exception):
            self._cancel()

    async def _start(self) -> None:
        assert self._request is not None
        address, endpoint, payload = self._request
        self._request = None
        try:
            self._conn = await self._client.connection(address)
        except EngineError as exc:
            self._inbox.finish(exc)
            return
        self._stream_id = self._conn.open_stream(self._inbox, endpoint, payload)

    def _cancel(self) -> None:
        self._request = None
        if not self._inbox.done:
            self._inbox.done = True
            if self._conn is not None:
                self._conn.cancel_stream(self._stream_id)


DEFAULT_MAX_BACKLOG_BYTES = 1 << 20


class RequestPlaneClient:
    def __init__(
        self,
        connect_timeout: float = 5.0,
        security: PlaneSecurity | None = None,
        max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.security = security or PlaneSecurity()
        self.max_backlog_bytes = max_backlog_bytes
        self._conns: dict[str, _ClientConnection] = {}
        self._connecting: dict[str, asyncio.Future[_ClientConnection]] = {}

    def stream(
        self, address: str, endpoint: str, payload: bytes, max_backlog_bytes: int | None = None
    ) -> ResponseStream:
        """Call `endpoint` on the worker at `address` ("host:port"); nothing is sent until the
        first `__anext__`. Failures arrive from the iterator as `EngineError`.
        `max_backlog_bytes` overrides the client's bound for this call."""
        backlog = self.max_backlog_bytes if max_backlog_bytes is None else max_backlog_bytes
        return ResponseStream(self, address, endpoint, payload, backlog)

    async def connection(self, address: str) -> _ClientConnection:
        conn = self._conns.get(address)
        if conn is not None and conn.is_open:
            return conn
        pending = self._connecting.get(address)
        if pending is None:
            pending = asyncio.get_running_loop().create_task(self._connect(address))
            self._connecting[address] = pending
            pending.add_done_callback(lambda _: self._connecting.pop(address, None))
        return await asyncio.shield(pending)

    async def _connect(self, address: str) -> _ClientConnection:
        host, _, port = address.rpartition(":")
        factory = partial(_ClientConnection, address, self.security.secret)
        tls = self.security.client_tls
        try:
            async with asyncio.timeout(self.connect_timeout):
                connecting = asyncio.get_running_loop().create_connection(
                    factory, host.strip("[]"), int(port), ssl=tls
                )
                transport, conn = await connecting
                try:
                    await conn.ready
                except BaseException:
                    transport.abort()
                    raise
        except (OSError, TimeoutError, ValueError) as exc:
            raise unavailable(f"cannot connect to {address}: {exc!r}") from exc
        self._conns[address] = conn
        return conn

    async def close(self) -> None:
        conns, self._conns = self._conns, {}
        for conn in conns.values():
            if conn.transport is not None:
                conn.transport.close()
