"""uvicorn's httptools protocol with the two limits uvicorn lacks: a header timeout and a
connection cap.

uvicorn times out idle keep-alive connections only, and its `limit_concurrency` answers 503 to
requests whose headers are complete: a client that opens connections and sends its headers a
byte at a time (slowloris) is held forever, one socket each. Here a connection whose request
headers are not complete `read_timeout_s` after it opened (or after its previous response) is
closed, and a connection beyond `max_connections` is closed as it arrives.

Each request's scope also carries two extensions for `asgi.Exchange`:
- `ABORT_EXTENSION`, a callable that drops the connection, for a client that has stopped
  reading (a write that cannot finish), where the response can be neither completed nor
  abandoned cleanly through ASGI;
- `CHUNK_WRITER_EXTENSION`, a `ChunkWriter`: a streamed body's chunks go straight to the
  transport, pre-framed, instead of through an ASGI message, the middleware's send wrappers,
  uvicorn's send and a stall timer, which cost about a tenth of a paced chunk's frontend CPU
  (docs/frontend.md, "Cost")."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

ABORT_EXTENSION = "weir.abort"
CHUNK_WRITER_EXTENSION = "weir.chunk_writer"


class ChunkWriter:
    """Writes body chunks of a started, chunked response as uvicorn's send would, but only
    when that send would write at once: anything else (not started, not chunked, the client
    gone, its socket buffer full) is `ready() == False`, and the caller sends through ASGI."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle

    def ready(self) -> bool:
        cycle = self._cycle
        return (
            cycle.chunked_encoding is True
            and not cycle.response_complete
            and not cycle.disconnected
            and not cycle.flow.write_paused
        )

    def write(self, body: bytes) -> None:
        if body:  # an empty chunk is the body's end marker
            self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))


class _GuardedHttpToolsProtocol(HttpToolsProtocol):
    max_connections = 0
    header_timeout_s = 0.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.abort()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._extensions: dict[str, Any] = {ABORT_EXTENSION: self.transport.abort}
        self.scope["extensions"] = self._extensions

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade, which has none
            self._extensions[CHUNK_WRITER_EXTENSION] = ChunkWriter(cycle)

    def on_response_complete(self) -> None:
        # A pipelined request already has its headers; only an idle connection waits for more.
        waiting = not self.pipeline
        super().on_response_complete()
        if waiting and not self.transport.is_closing():
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        self.transport.abort()


def guarded_protocol(max_connections: int, header_timeout_s: float) -> type[asyncio.Protocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these limits."""
    attrs: dict[str, Any] = {"max_connections": max_connections, "header_timeout_s": header_timeout_s}
    return type("GuardedHttpToolsProtocol", (_GuardedHttpToolsProtocol,), attrs)
