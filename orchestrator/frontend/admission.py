"""Admission control: a bounded FIFO per model in front of its workers.

A request is admitted at once while some routable worker of its model is not busy; otherwise
it waits in the model's queue and is admitted, oldest first, when a request of the model
finishes or a load report shows a worker with room, or turned away with 429 and Retry-After
once the queue is full or it has waited `max_queue_wait_s`. Busy follows NVIDIA Dynamo's
thresholds: KV blocks in use over `active_decode_blocks_threshold` (the router's view, which
counts its own in-flight requests at once) or prompt tokens queued for prefill over
`active_prefill_tokens_threshold` (the worker's last load report plus the uncached prompt
tokens routed to it since). With both unset nothing
is ever busy and admission costs one attribute test. A worker whose circuit breaker is open
(router/table.py: its connection was refused, and its back-off has not ended) is no room
either: a request admitted onto it would only fail over. A tripped worker sends no load
report when its back-off ends, so while requests wait the queue also wakes itself then.

One admission at a time is handed out: the next is considered once the admitted request has
been routed (its blocks then count in the router's load), so one finished request does not
release the whole queue on a stale view."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from orchestrator.frontend.config import FrontendConfig
from orchestrator.frontend.errors import RateLimited
from orchestrator.frontend.metrics import ModelMetrics
from router.table import ModelRoutes

# Seconds a turned-away client is told to wait: queues drain at the pace requests finish.
RETRY_AFTER_S = 1


class Admission:
    def __init__(self, config: FrontendConfig, routes: ModelRoutes, metrics: ModelMetrics) -> None:
        self.routes = routes
        self.decode_threshold = config.active_decode_blocks_threshold
        self.prefill_threshold = config.active_prefill_tokens_threshold
        self.enabled = self.decode_threshold is not None or self.prefill_threshold is not None
        self.max_queued = config.max_queued_requests
        self.max_wait_s = config.max_queue_wait_s
        self.metrics = metrics
        self._queue: deque[asyncio.Future[None]] = deque()
        # A waiter was admitted and has not yet run on to routing.
        self._handing_over = False
        # The wake-up due when the next open breaker's back-off ends, while requests wait.
        self._breaker_wake: asyncio.TimerHandle | None = None
        if self.enabled:
            routes.router.on_load = self.wake

    def has_room(self) -> bool:
        """Some routable worker with a closed breaker is below both thresholds, or no such
        worker is left. With none routable at all the router answers 503 at once instead of
        letting the request wait for nothing. With every routable worker tripped the router
        does not refuse either: it places the request on the tripped worker whose back-off ends
        first (the probe, `ModelRoutes.select`), failing over from there. Holding the request
        back would help no one (a tripped worker sends no load reports to wake the queue), so
        it is admitted and that probe decides, as it would without admission control. Only
        when some untripped worker exists do tripped ones count as no room: the request waits
        for a healthy worker instead of being routed to a dead one and failing over."""
        trips = self.routes.trips
        now = self.routes.clock() if trips else 0.0
        healthy = False
        for worker_id, load in self.routes.router.workers.items():
            if load.draining:
                continue
            trip = trips.get(worker_id) if trips else None
            if trip is not None and now < trip.retry_at:
                continue  # breaker open: not due for a probe yet
            healthy = True
            if self.decode_threshold is not None and load.kv_usage >= self.decode_threshold:
                continue
            if self.prefill_threshold is not None and load.prefill_tokens >= self.prefill_threshold:
                continue
            return True
        return not healthy

    async def admit(self) -> None:
        """Return once the request may be dispatched; raise RateLimited if it may not. Every
        admitted request must be followed by `release()` when it ends."""
        if not self.enabled:
            return
        arrived = time.perf_counter()
        if not self._queue and not self._handing_over and self.has_room():
            self.metrics.queue_wait.observe(0.0)
            return
        if len(self._queue) >= self.max_queued:
            self._reject("queue_full", f"{self.max_queued} requests are already waiting for this model")
        waiter = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        self.metrics.queued.inc()
        self._wake_when_a_breaker_closes()
        try:
            async with asyncio.timeout(self.max_wait_s):
                await waiter
        except BaseException as exc:
            admitted = waiter.done() and not waiter.cancelled()
            if not admitted:
                if waiter in self._queue:  # else `wake` already dropped it, cancelled
                    self._queue.remove(waiter)
                    self.metrics.queued.dec()
                if isinstance(exc, TimeoutError):
                    self._reject("queue_timeout", f"no worker had room within {self.max_wait_s:g} s")
                raise
            self._handed_over()
            if not isinstance(exc, TimeoutError):  # cancelled just after admission: pass it on
                self.release()
                raise
            # Admitted just as the time ran out: take it.
        else:
            self._handed_over()
        self.metrics.queue_wait.observe(time.perf_counter() - arrived)

    def release(self) -> None:
        """An admitted request ended: its worker may have room for the next."""
        if self._queue:
            self.wake()

    def wake(self) -> None:
        while self._queue and not self._handing_over and self.has_room():
            waiter = self._queue.popleft()
            self.metrics.queued.dec()
            if not waiter.done():  # a done one was cancelled: its task is leaving anyway
                self._handing_over = True
                waiter.set_result(None)
        self._wake_when_a_breaker_closes()

    def _wake_when_a_breaker_closes(self) -> None:
        if self._breaker_wake is not None or not self._queue or not self.routes.trips:
            return
        now = self.routes.clock()
        due = [trip.retry_at for trip in self.routes.trips.values() if trip.retry_at > now]
        if due:
            self._breaker_wake = asyncio.get_running_loop().call_later(min(due) - now, self._breaker_woke)

    def _breaker_woke(self) -> None:
        self._breaker_wake = None
        self.wake()

    def _handed_over(self) -> None:
        self._handing_over = False
        # Runs after the admitted request's task next yields, by then routed and counted.
        asyncio.get_running_loop().call_soon(self.wake)

    def _reject(self, reason: str, why: str) -> None:
        self.metrics.rejected[reason].inc()
        raise RateLimited(f"The model is at capacity: {why}. Retry later.", RETRY_AFTER_S)
