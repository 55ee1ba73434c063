"""What both ends of a request-plane connection share: framing and batched writes.

Frames queued in one event-loop iteration leave in one `transport.write` (one syscall), so
a step that produces deltas for 100 streams costs one send, not 100. Writers never await per
frame; a producer checks `paused` and awaits `writable()` only when the socket is backed up.
A large `Data` payload (KV records) is the exception: it goes to the transport at once, as
is, after its header (frames.data_header), so it is never copied into the batch and the
transport's flow control paces whoever produces many of them.

Reading is linear in the bytes received: a partial frame waits in one bytearray that grows by
appending and loses its consumed head by `del` (which CPython does in place), never a copy of
the whole buffer per read. A length prefix over `max_frame_bytes` closes the connection before
any of that frame's body is buffered. Before frames, a subclass may ask for a fixed number of
raw bytes (`expect_raw`): the cluster-secret handshake (security.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import cast

import msgspec

from orchestrator.runtime.request_plane.frames import Data, Frame, append_frame, data_header, decoder
from orchestrator.runtime.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)

# Data payloads from this size on skip the batch (see above); smaller ones are cheaper batched.
DIRECT_WRITE_BYTES = 64 * 1024


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
    def __init__(self, max_frame_bytes: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.max_frame_bytes = max_frame_bytes
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self._rbuf = bytearray()
        self._raw_needed = 0
        self._wbuf = bytearray()
        self._flush_pending = False
        self._writable: asyncio.Future[None] | None = None
        self.warn = ThrottledWarning(log)

    # ------------------------------------------------------------------ subclass hooks

    def frame_received(self, frame: Frame) -> None:
        raise NotImplementedError

    def malformed_frame(self, raw: bytes, exc: Exception) -> None:
        self.warn(f"request plane: dropped a malformed frame ({exc})")

    def raw_received(self, data: bytes) -> None:
        """The `expect_raw` bytes asked for, all of them."""
        raise NotImplementedError

    def expect_raw(self, size: int) -> None:
        """Hand the next `size` bytes to `raw_received` instead of parsing them as frames."""
        self._raw_needed = size

    def refuse(self, reason: str) -> None:
        """Close the connection for `reason` (throttled in the log); nothing more is read."""
        self.warn(f"request plane: {reason}; closing the connection from {self.peer}")
        if self.transport is not None:
            self.transport.abort()

    @property
    def peer(self) -> str:
        name = self.transport.get_extra_info("peername") if self.transport is not None else None
        return str(name[0]) if isinstance(name, tuple) and name else "?"

    # ------------------------------------------------------------------ writing

    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, frame: Frame) -> None:
        if self.transport is None:
            return
        if type(frame) is Data and len(frame.payload) >= DIRECT_WRITE_BYTES:
            self._flush()  # what was queued before it leaves before it
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(data_header(frame.stream_id, len(frame.payload)))
                self.transport.write(frame.payload)
            return
        append_frame(self._wbuf, frame)
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        if self._wbuf and self.transport is not None and not self.transport.is_closing():
            # Handed over, not copied: the transport may keep it, so it is never touched again.
            self.transport.write(self._wbuf)
        self._wbuf = bytearray()

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
        self._rbuf = bytearray()
        self._release_writers()

    def data_received(self, data: bytes) -> None:
        if self._rbuf:
            self._rbuf += data
            del self._rbuf[: self._parse(self._rbuf)]
        else:  # the common case: whole frames, parsed straight from what arrived
            pos = self._parse(data)
            if pos < len(data):
                self._rbuf += memoryview(data)[pos:]

    def _parse(self, buf: bytes | bytearray) -> int:
        """Handle every complete item in `buf`; returns how many bytes were consumed."""
        end, pos = len(buf), 0
        with memoryview(buf) as view:
            while self.is_open:
                if self._raw_needed:
                    size = self._raw_needed
                    if end - pos < size:
                        return pos
                    self._raw_needed = 0
                    self.raw_received(bytes(view[pos : pos + size]))
                    pos += size
                    continue
                if end - pos < 4:
                    return pos
                size = int.from_bytes(view[pos : pos + 4], "big")
                if size > self.max_frame_bytes:
                    # Garbage or abuse; everything after it is unparseable either way.
                    self.refuse(f"a frame of {size} bytes exceeds the limit of {self.max_frame_bytes}")
                    break
                stop = pos + 4 + size
                if stop > end:
                    return pos
                try:
                    frame = decoder.decode(view[pos + 4 : stop])
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    self.malformed_frame(bytes(view[pos + 4 : stop]), exc)
                else:
                    self.frame_received(frame)
                pos = stop
        return end  # closed: drop the rest
