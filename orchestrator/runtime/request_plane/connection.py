"""What both ends of a request-plane connection share: framing and batched writes.

Frames queued in one event-loop iteration leave in one `transport.write` (one syscall), so
a step that produces deltas for 100 streams costs one send, not 100. Writers never await per
frame; a producer checks `paused` and awaits `writable()` only when the socket is backed up.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import cast

import msgspec

from orchestrator.runtime.request_plane.frames import MAX_FRAME_BYTES, Frame, append_frame, decoder
from orchestrator.runtime.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)


def configure_socket(sock: socket.socket) -> None:
    """No Nagle delay (frames are already batched), and TCP keep-alive so a peer that vanished
    without a FIN/RST (node lost, cable cut) fails its streams within ~25 s, not hours."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


class FrameProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self._rbuf = bytearray()
        self._wbuf = bytearray()
        self._flush_pending = False
        self._writable: asyncio.Future[None] | None = None
        self.warn = ThrottledWarning(log)

    # ------------------------------------------------------------------ subclass hooks

    def frame_received(self, frame: Frame) -> None:
        raise NotImplementedError

    def malformed_frame(self, raw: bytes, exc: Exception) -> None:
        self.warn(f"request plane: dropped a malformed frame ({exc})")

    # ------------------------------------------------------------------ writing

    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, frame: Frame) -> None:
        if self.transport is None:
            return
        append_frame(self._wbuf, frame)
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        if self._wbuf and self.transport is not None and not self.transport.is_closing():
            self.transport.write(bytes(self._wbuf))
        self._wbuf.clear()

    async def writable(self) -> None:
        if self.paused:
            if self._writable is None:
                self._writable = self.loop.create_future()
            await asyncio.shield(self._writable)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._release_writers()

    def _release_writers(self) -> None:
        if self._writable is not None:
            if not self._writable.done():
                self._writable.set_result(None)
            self._writable = None

    # ------------------------------------------------------------------ reading

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's transports do not subclass asyncio's.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            configure_socket(sock)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.paused = False
        self._release_writers()

    def data_received(self, data: bytes) -> None:
        if self._rbuf:
            self._rbuf += data
            data = bytes(self._rbuf)
            self._rbuf.clear()
        view = memoryview(data)
        end, pos = len(data), 0
        while end - pos >= 4:
            size = int.from_bytes(view[pos : pos + 4], "big")
            if size > MAX_FRAME_BYTES:
                # The length prefix is garbage, so is everything after it: drop the connection.
                self.warn(f"request plane: frame of {size} bytes exceeds the limit; closing")
                if self.transport is not None:
                    self.transport.abort()
                return
            stop = pos + 4 + size
            if stop > end:
                break
            try:
                frame = decoder.decode(view[pos + 4 : stop])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.malformed_frame(data[pos + 4 : stop], exc)
            else:
                self.frame_received(frame)
            pos = stop
        if pos < end:
            self._rbuf += view[pos:]
