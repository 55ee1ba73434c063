"""Health probes on a port of their own (`--probe-port`), answered by a thread.

Under a burst the event loop runs for hundreds of milliseconds between looks at its sockets:
with 3,000 requests at concurrency 1,500 (`tests/chaos/test_overload.py` scaled up) `/health`
on the API port waited 540 ms at p99, and answering it in the HTTP protocol's own callback did
not help, because that callback too runs only once per loop iteration. A kubelet that hears
nothing within its timeout restarts a frontend that is merely busy. The probe thread needs only
the GIL, which the loop hands over every `sys.getswitchinterval()` (5 ms).

A busy loop must still be told from a wedged one: the loop stamps a heartbeat every
`HEARTBEAT_S`, and `/live` fails once the stamp is older than `STALL_S`. `/health` answers what
the API port's `/health` answers (workers known, not draining), plus the same stall test.

One request at a time, each with a short socket timeout: the port serves kubelets, not users,
and a client that trickles its request cannot hold the thread for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import logging
import socketserver
import threading
import time
from collections.abc import Callable

log = logging.getLogger("weir.frontend")

HEARTBEAT_S = 0.5
STALL_S = 10.0
_SOCKET_TIMEOUT_S = 2.0

# (status, JSON body), computed from the frontend's state; called on the probe thread, so it
# may only read plain attributes.
Probe = Callable[[], tuple[int, bytes]]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    timeout = _SOCKET_TIMEOUT_S

    def do_GET(self) -> None:
        probe = self.server.probes.get(self.path)
        if probe is None:
            status, body = 404, b'{"status":"not found"}'
        elif self.server.stalled():
            status, body = 503, b'{"status":"event loop stalled"}'
        else:
            status, body = probe()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # probes every few seconds: no line each


class _Server(socketserver.TCPServer):
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], probes: dict[str, Probe], reuse_port: bool) -> None:
        self.allow_reuse_port = reuse_port  # read by server_bind, inside super().__init__
        super().__init__(address, _Handler)
        self.probes = probes
        self.beat = time.monotonic()

    def stalled(self) -> bool:
        return time.monotonic() - self.beat > STALL_S


class ProbeServer:
    def __init__(self, host: str, port: int, probes: dict[str, Probe], reuse_port: bool = False) -> None:
        """`reuse_port`: share `port` with sibling frontend processes (shared_port.py)."""
        self._server = _Server((host, port), probes, reuse_port)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="weir-probes", daemon=True)
        self._heartbeat: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Call on the event loop: the heartbeat runs there."""
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat(), name="weir-probe-heartbeat")
        self._thread.start()

    async def _beat(self) -> None:
        while True:
            self._server.beat = time.monotonic()
            await asyncio.sleep(HEARTBEAT_S)

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self._thread.is_alive():
            await asyncio.to_thread(self._server.shutdown)
        self._server.server_close()
