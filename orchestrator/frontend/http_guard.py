"""uvicorn's httptools protocol with the two limits uvicorn lacks: a header timeout and a
connection cap.

uvicorn times out idle keep-alive connections only, and its `limit_concurrency` answers 503 to
requests whose headers are complete: a client that opens connections and sends its headers a
byte at a time (slowloris) is held forever, one socket each. Here a connection whose request
headers are not complete `read_timeout_s` after it opened (or after its previous response) is
closed, and a connection beyond `max_connections` is closed as it arrives.

Each request's scope also carries `ABORT_EXTENSION`, a callable that drops the connection: what
`asgi.Exchange` uses on a client that has stopped reading (a write that cannot finish), where
the response can be neither completed nor abandoned cleanly through ASGI."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

ABORT_EXTENSION = "weir.abort"


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
        # asgiref's types want every extension to be a dict; this one is a callable.
        self.scope["extensions"] = {ABORT_EXTENSION: self.transport.abort}  # type: ignore[dict-item]

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

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
