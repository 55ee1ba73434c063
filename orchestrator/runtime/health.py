"""A tiny HTTP endpoint for worker processes: /live, /health and /metrics.

Workers have no web framework on their hot path, so this is plain asyncio: one request per
connection, GET only. `/live` answers 200 while the event loop runs; `/health` answers 200
when the process is ready to take requests (started, not draining) and 503 otherwise;
`/metrics` is the Prometheus text format of the default registry.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


class HealthServer:
    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str = "0.0.0.0", port: int = 0) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            method, path, *_ = [*head.split(b" ", 2), b"", b""]
            status, content_type, body = self._route(method, path.split(b"?", 1)[0])
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _route(self, method: bytes, path: bytes) -> tuple[str, str, bytes]:
        if method != b"GET":
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        if path == b"/live":
            return "200 OK", "text/plain", b"live\n"
        if path == b"/health":
            if self._ready():
                return "200 OK", "text/plain", b"ready\n"
            return "503 Service Unavailable", "text/plain", b"not ready\n"
        if path == b"/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest()
        return "404 Not Found", "text/plain", b"not found\n"
