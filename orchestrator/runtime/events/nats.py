"""Event plane on NATS (nats-py core pub/sub, no JetStream).

Credentials travel in the URL as nats-py reads them (`nats://user:password@host:4222`,
`nats://token@host:4222`) and never reach a log line; `tls://host:4222` connects over TLS,
verified against the system's CAs or the bundle `SSL_CERT_FILE` names.

The connection is made on first use and then kept by nats-py, which reconnects forever and
re-subscribes on its own; while NATS is away, publishes are buffered (up to nats-py's pending
size) and then fail, and subscriptions simply wait. A subscription made while NATS cannot be
reached keeps trying in the background instead of failing its consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats
from nats.aio.client import Client
from nats.aio.subscription import Subscription as NatsSub
from nats.errors import Error as NatsError

from orchestrator.runtime.events.base import EventPlane, Subscription
from orchestrator.runtime.throttled_log import ThrottledWarning
from orchestrator.runtime.urls import redacted

log = logging.getLogger(__name__)

_RETRY_MAX_S = 2.0


class NatsEventPlane(EventPlane):
    def __init__(self, url: str) -> None:
        self.url = url
        self._shown = redacted(url)
        self._nc: Client | None = None
        self._lock = asyncio.Lock()
        self._subscriptions: set[NatsSubscription] = set()
        self.warn = ThrottledWarning(log)  # an outage fails every retry
        self._closing = False

    async def connection(self) -> Client:
        if self._nc is not None:
            return self._nc
        async with self._lock:
            if self._nc is None:
                self._nc = await nats.connect(
                    self.url,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    connect_timeout=2,
                    ping_interval=10,
                    error_cb=self._on_error,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                )
            return self._nc

    async def publish(self, subject: str, data: bytes) -> None:
        nc = self._nc if self._nc is not None else await self.connection()
        await nc.publish(subject, data)

    async def subscribe(self, subject: str) -> Subscription:
        """Live on return when NATS is reachable; otherwise it keeps trying in the background."""
        sub = NatsSubscription(self, subject)
        self._subscriptions.add(sub)
        await sub.try_start()
        return sub

    async def close(self) -> None:
        self._closing = True  # nats-py reports its own close as a disconnect
        for sub in list(self._subscriptions):
            await sub.close()
        if self._nc is not None:
            with contextlib.suppress(NatsError, OSError):
                await self._nc.close()
            self._nc = None

    async def _on_error(self, exc: Exception) -> None:
        self.warn(f"NATS {self._shown}: {exc!r}")

    async def _on_disconnected(self) -> None:
        if not self._closing:
            self.warn(f"NATS {self._shown}: disconnected, reconnecting")

    async def _on_reconnected(self) -> None:
        log.info("NATS %s: reconnected", self._shown)


class NatsSubscription(Subscription):
    def __init__(self, plane: NatsEventPlane, subject: str) -> None:
        self.subject = subject
        self._plane = plane
        self._sub: NatsSub | None = None
        self._closed = asyncio.Event()

    async def __anext__(self) -> bytes:
        sub = self._sub if self._sub is not None else await self._start()
        # Iterating `sub.messages` ends when the subscription is removed; so does this.
        msg = await anext(sub.messages)
        return msg.data

    async def try_start(self) -> bool:
        try:
            nc = await self._plane.connection()
            self._sub = await nc.subscribe(self.subject)
        except (TimeoutError, NatsError, OSError) as exc:
            self._plane.warn(f"NATS subscribe {self.subject!r} failed ({exc!r}); retrying")
            return False
        # subscribe() only queues the SUB; once the server answers a PING sent after it, it has
        # the SUB, so whatever anyone publishes from then on reaches us. nats-py (2.16) writes
        # flush()'s PING straight to the socket, ahead of its pending buffer, so the first PONG
        # proves nothing; its flusher has written the SUB by then, and a second PING follows it.
        # If NATS dropped meanwhile, nats-py re-subscribes on reconnect: the subscription stands.
        try:
            for _ in range(2):
                await nc.flush(timeout=2)
        except (TimeoutError, NatsError, OSError) as exc:
            self._plane.warn(f"NATS subscribe {self.subject!r}: no answer yet ({exc!r})")
        return True

    async def _start(self) -> NatsSub:
        delay = 0.1
        while not self._closed.is_set():
            if await self.try_start():
                assert self._sub is not None
                return self._sub
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), delay)
            delay = min(delay * 2, _RETRY_MAX_S)
        raise StopAsyncIteration

    async def close(self) -> None:
        self._closed.set()
        self._plane._subscriptions.discard(self)
        if self._sub is not None:
            with contextlib.suppress(NatsError, OSError):
                await self._sub.unsubscribe()
