"""Prometheus metrics of a worker process, labelled by worker instance (one process may host many)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge

from orchestrator.runtime.protocol import LoadReport

REQUESTS = Counter(
    "weir_worker_requests",
    "Generate calls by outcome (ok, error, cancelled, rejected, invalid)",
    ["worker", "outcome"],
)
# Against a router's weir_router_kv_events_applied: how far its index lags what workers cache.
KV_EVENTS_PUBLISHED = Counter("weir_worker_kv_events_published", "KV events published to routers", ["worker"])
IN_FLIGHT = Gauge("weir_worker_in_flight_requests", "Generate calls being served", ["worker"])
DRAINING = Gauge("weir_worker_draining", "1 while the worker drains", ["worker"])
WAITING = Gauge("weir_worker_waiting_requests", "Requests queued in the engine", ["worker"])
KV_BLOCKS_USED = Gauge("weir_worker_kv_blocks_active", "KV blocks in use", ["worker"])
KV_BLOCKS_TOTAL = Gauge("weir_worker_kv_blocks_total", "KV blocks in the engine's pool", ["worker"])

_PER_WORKER = (IN_FLIGHT, DRAINING, WAITING, KV_BLOCKS_USED, KV_BLOCKS_TOTAL)


def observe_load(load: LoadReport, in_flight: int) -> None:
    IN_FLIGHT.labels(load.worker_id).set(in_flight)
    WAITING.labels(load.worker_id).set(load.waiting_requests)
    KV_BLOCKS_USED.labels(load.worker_id).set(load.active_blocks)
    KV_BLOCKS_TOTAL.labels(load.worker_id).set(load.total_blocks)


def forget(worker_id: str) -> None:
    """Drop a stopped worker's gauges (counters stay: they are totals)."""
    for gauge in _PER_WORKER:
        with contextlib.suppress(KeyError):
            gauge.remove(worker_id)
