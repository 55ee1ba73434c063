"""Feeds a `Router` from the event plane and keeps its KV index whole.

Consumes a model's `.kv` (KV event batches), `.load` (load reports) and `.inflight` (replica
routers' sends and finishes) subjects, and publishes this router's own in-flight changes on
`.inflight`: what changed since its last message, as one list, so a busy router sends one
message per event-loop turn instead of two per request, to every replica. It does so only
while a replica listens: routers announce themselves on `.routers` every `HEARTBEAT_S`, a
router that hears one it did not know answers at once with its own heartbeat and its requests
in flight, and a replica silent for `SILENT_PERIODS` heartbeats is forgotten with the load
counted for it. A router alone (one frontend process) sends nothing per request. Whenever the
router reports a worker it cannot trust (never synced, a gap in its event ids), the worker's
snapshot is fetched through `fetch_snapshot` and applied; a failed fetch is retried with
backoff while the worker stays registered.

`start()` returns once every worker the router knows at that moment is synced (or
`sync_timeout_s` passed): a restarted router rebuilds its index before it routes by KV,
instead of sending a burst of requests to workers that look cold. `wait_synced()` does the
same later, e.g. after the frontend's first discovery listing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from orchestrator.runtime.events import EventPlane
from orchestrator.runtime.events.base import Subscription
from orchestrator.runtime.protocol import KvEventBatch, KvSnapshot, LoadReport, subject
from router.indexer import KvIndexer
from router.protocols import InflightUpdate, RouterHeartbeat
from router.router import Router

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# A replica is forgotten after this many heartbeat periods of silence: three missed, and some
# slack for a busy event loop.
SILENT_PERIODS = 3.5

FetchSnapshot = Callable[[str], Awaitable[KvSnapshot]]


class RouterSubscriber:
    def __init__(
        self,
        router: Router,
        event_plane: EventPlane,
        namespace: str,
        model: str,
        fetch_snapshot: FetchSnapshot,
        *,
        sync_timeout_s: float = 10.0,
        retry_s: float = 0.5,
        max_retry_s: float = 10.0,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.router = router
        self.plane = event_plane
        self.fetch_snapshot = fetch_snapshot
        self.sync_timeout_s = sync_timeout_s
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.heartbeat_s = heartbeat_s
        self._subjects = {
            kind: subject(namespace, model, kind) for kind in ("kv", "load", "inflight", "routers")
        }
        self._subscriptions: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._fetching: dict[str, asyncio.Task[None]] = {}
        self._retry_at: dict[str, tuple[float, float]] = {}  # worker -> (next try, backoff)
        self._wake = asyncio.Event()
        self._outbox: list[InflightUpdate] = []
        self._outbox_ready = asyncio.Event()
        self._peers: dict[str, float] = {}  # replica router id -> when last heard (monotonic)
        self._heartbeat_now = asyncio.Event()

    async def start(self) -> None:
        handlers: dict[str, Callable[[bytes], None]] = {
            "load": self._on_load,
            "inflight": self._on_inflight,
            "routers": self._on_heartbeat,
        }
        if isinstance(self.router.index, KvIndexer):
            handlers["kv"] = self._on_kv
            self._tasks.append(asyncio.create_task(self._resync_loop(), name="router-resync"))
        for kind, handle in handlers.items():
            sub = await self.plane.subscribe(self._subjects[kind])
            self._subscriptions.append(sub)
            self._tasks.append(asyncio.create_task(self._consume(sub, handle), name=f"router-{kind}"))
        self._tasks.append(asyncio.create_task(self._publish_inflight(), name="router-inflight-out"))
        self._tasks.append(asyncio.create_task(self._heartbeats(), name="router-heartbeat"))
        self.router.on_inflight = self._queue_inflight
        await self.wait_synced(self.sync_timeout_s)

    async def stop(self) -> None:
        self.router.on_inflight = None
        for sub in self._subscriptions:
            await sub.close()
        tasks = [*self._tasks, *self._fetching.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._subscriptions.clear()
        self._tasks.clear()
        self._fetching.clear()

    async def wait_synced(self, timeout_s: float) -> bool:
        """Until every registered worker's index part is trusted; False on timeout."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()
        while self.router.needs_resync():
            if time.monotonic() >= deadline:
                log.warning("KV index not synced for %s after %.1f s", self.router.needs_resync(), timeout_s)
                return False
            await asyncio.sleep(0.01)
        return True

    # ------------------------------------------------------------------ inbound

    async def _consume(self, sub: Subscription, handle: Callable[[bytes], None]) -> None:
        async for data in sub:
            try:
                handle(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("dropping a malformed message: %s", exc)
            except Exception:  # one bad message must not stop the index from following events
                log.exception("failed to apply an event-plane message")

    def _on_kv(self, data: bytes) -> None:
        if self.router.apply_kv_batch(_decode_kv(data)):
            self._wake.set()

    def _on_load(self, data: bytes) -> None:
        if self.router.apply_load(_decode_load(data)):
            self._wake.set()

    def _on_heartbeat(self, data: bytes) -> None:
        router_id = _decode_heartbeat(data).router_id
        if router_id == self.router.router_id:
            return
        if router_id not in self._peers:
            log.info("router replica %s joined; sharing in-flight load with it", router_id)
            # Answer at once, so it need not wait a heartbeat to know us, and tell it what we
            # have in flight, which we did not publish while no replica listened.
            self._heartbeat_now.set()
            updates = self.router.inflight_updates()
            if updates:
                self._outbox.extend(updates)
                self._outbox_ready.set()
        self._peers[router_id] = time.monotonic()

    def _on_inflight(self, data: bytes) -> None:
        updates = _decode_inflight(data)
        # A single update is what a replica of an earlier version sends, during a rolling update.
        for update in updates if isinstance(updates, list) else (updates,):
            self.router.apply_inflight(update)

    # ------------------------------------------------------------------ resync

    async def _resync_loop(self) -> None:
        while True:
            now = time.monotonic()
            for worker_id in self.router.needs_resync():
                next_try, _ = self._retry_at.get(worker_id, (0.0, 0.0))
                if worker_id not in self._fetching and next_try <= now:
                    self._fetching[worker_id] = asyncio.create_task(self._resync(worker_id))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.retry_s)

    async def _resync(self, worker_id: str) -> None:
        index = self.router.index
        reason = "gap" if isinstance(index, KvIndexer) and index.was_synced(worker_id) else "join"
        try:
            snapshot = await self.fetch_snapshot(worker_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure of a remote call: retry later, keep routing
            _, backoff = self._retry_at.get(worker_id, (0.0, self.retry_s / 2))
            backoff = min(backoff * 2, self.max_retry_s)
            self._retry_at[worker_id] = (time.monotonic() + backoff, backoff)
            log.warning("KV snapshot of %s failed (retry in %.1f s): %s", worker_id, backoff, exc)
            return
        finally:
            self._fetching.pop(worker_id, None)
        self._retry_at.pop(worker_id, None)
        if snapshot.worker_id != worker_id:  # engines leave the id to their host
            snapshot = msgspec.structs.replace(snapshot, worker_id=worker_id)
        self.router.metrics.resyncs.labels(self.router.model, reason).inc()
        if self.router.apply_kv_snapshot(snapshot):
            self._wake.set()  # batches after the snapshot still have a gap: fetch again
        log.info("resynced %s from its snapshot at event %d (%s)", worker_id, snapshot.event_id, reason)

    # ------------------------------------------------------------------ outbound

    def _queue_inflight(self, update: InflightUpdate) -> None:
        if self._peers:  # else nobody listens; a replica that appears is sent the whole state
            self._outbox.append(update)
            self._outbox_ready.set()

    async def _heartbeats(self) -> None:
        heartbeat = msgspec.msgpack.encode(RouterHeartbeat(router_id=self.router.router_id))
        topic = self._subjects["routers"]
        while True:
            try:
                await self.plane.publish(topic, heartbeat)
            except Exception as exc:  # the event plane degrades, routing goes on
                log.warning("cannot publish a router heartbeat: %s", exc)
            self._forget_silent_peers()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heartbeat_now.wait(), self.heartbeat_s)
            self._heartbeat_now.clear()

    def _forget_silent_peers(self) -> None:
        cutoff = time.monotonic() - SILENT_PERIODS * self.heartbeat_s
        for router_id in [r for r, heard in self._peers.items() if heard < cutoff]:
            del self._peers[router_id]
            self.router.forget_peer(router_id)
            log.info("router replica %s went silent; its in-flight load no longer counts", router_id)

    async def _publish_inflight(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self._subjects["inflight"]
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            updates, self._outbox = self._outbox, []
            try:
                await self.plane.publish(topic, encoder.encode(updates))
            except Exception as exc:  # the event plane degrades, routing goes on
                log.warning("cannot publish in-flight load: %s", exc)


_decode_kv = msgspec.msgpack.Decoder(KvEventBatch).decode
_decode_load = msgspec.msgpack.Decoder(LoadReport).decode
_decode_inflight = msgspec.msgpack.Decoder(list[InflightUpdate] | InflightUpdate).decode
_decode_heartbeat = msgspec.msgpack.Decoder(RouterHeartbeat).decode
