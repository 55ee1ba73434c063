"""Plain-ASGI plumbing for the generation routes: bounded body reads, responses, disconnects.

The generation routes bypass FastAPI's request/response wrappers (and Starlette's
StreamingResponse, which runs an anyio task group per request): an `Exchange` writes ASGI
messages directly, and a small watcher task cancels the handler when the client hangs up."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from orchestrator.frontend.errors import BodyTooLarge
from orchestrator.frontend.http_guard import ChunkWriter

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
DONE_EVENT = b"data: [DONE]\n\n"
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
# A client that keeps sending past the limit is cut off instead of being drained forever.
_DRAIN_FACTOR = 8


class ClientGone(Exception):
    """The client disconnected before the request body was read."""


class StreamStalled(Exception):
    """The client stopped reading: one response write did not finish within the stall timeout."""


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request body, at most `limit` bytes. A larger body raises BodyTooLarge after the
    rest has been discarded chunk by chunk (never held in memory), so the client, which
    usually sends all of it before reading, still receives the 413."""
    declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
    too_large = declared is not None and declared.isdigit() and int(declared) > limit
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            too_large = True
        if not too_large:
            chunks.append(body)
        elif size > limit * _DRAIN_FACTOR:
            break
        if not message.get("more_body", False):
            break
    if too_large:
        raise BodyTooLarge(limit)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class Exchange:
    """One HTTP exchange: response state plus the disconnect watcher.

    A write waits while the client's socket buffer is full (uvicorn's flow control), so a slow
    reader slows its own stream instead of growing a buffer here; one that reads nothing for
    `stall_timeout_s` has its connection dropped (`abort`, from the server) and the write
    raises StreamStalled, which ends the handler and closes its worker streams. Body chunks
    that can be written at once skip ASGI (`http_guard.ChunkWriter`), and the stall timer with
    it: only a write that has to wait can stall."""

    __slots__ = (
        "_abort",
        "_chunks",
        "_send",
        "_stall_timeout_s",
        "_watcher",
        "disconnected",
        "finished",
        "started",
        "status",
    )

    def __init__(
        self,
        send: Send,
        stall_timeout_s: float,
        abort: Callable[[], None] | None,
        chunks: ChunkWriter | None = None,
    ) -> None:
        self._send = send
        self._chunks = chunks
        self._stall_timeout_s = stall_timeout_s
        self._abort = abort
        self._watcher: asyncio.Task[None] | None = None
        self.started = False
        self.finished = False
        self.disconnected = False
        self.status = 0

    def watch_disconnect(self, receive: Receive) -> None:
        """Cancel the current task when the client hangs up (the body must be read already)."""
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive, asyncio.current_task()))

    async def _watch(self, receive: Receive, task: asyncio.Task[Any] | None) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        if task is not None:
            task.cancel()

    def stop_watching(self) -> None:
        # Before the last body message: completing the response wakes `receive` with a
        # disconnect, which must not cancel a handler that is merely finishing.
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    async def _bounded_send(self, message: Message) -> None:
        try:
            async with asyncio.timeout(self._stall_timeout_s):
                await self._send(message)
        except TimeoutError:
            # Dropping the connection (instead of letting the disconnect watcher see it) keeps
            # the handler's own cleanup from being cancelled halfway.
            self.stop_watching()
            if self._abort is not None:
                self._abort()
            raise StreamStalled from None

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        await self._bounded_send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, body: bytes) -> None:
        chunks = self._chunks
        if chunks is not None and chunks.ready():
            chunks.write(body)
            return
        await self._bounded_send({"type": "http.response.body", "body": body, "more_body": True})

    async def finish(self, body: bytes) -> None:
        self.stop_watching()
        self.finished = True
        await self._bounded_send({"type": "http.response.body", "body": body, "more_body": False})

    async def json(self, status: int, body: bytes, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self.stop_watching()
        self.started = self.finished = True
        self.status = status
        await self._bounded_send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*JSON_HEADERS, (b"content-length", str(len(body)).encode()), *headers],
            }
        )
        await self._bounded_send({"type": "http.response.body", "body": body, "more_body": False})

    async def close(self) -> None:
        """Stop the watcher for good (after the handler returned or failed)."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
