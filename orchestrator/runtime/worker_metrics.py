"""Prometheus metrics of a worker process, labelled by worker instance (one process may host many)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

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
# KV data plane (disaggregation): a prefill worker serves transfers, a decode worker pulls them.
KV_TRANSFERS = Counter(
    "weir_worker_kv_transfers",
    "KV transfers by direction (served, pulled) and outcome (ok, partial, failed, expired)",
    ["worker", "direction", "outcome"],
)
KV_TRANSFER_BYTES = Counter(
    "weir_worker_kv_transfer_bytes",
    "KV record bytes moved, by direction and transport (shm, tcp)",
    ["worker", "direction", "transport"],
)
KV_TRANSFER_SECONDS = Histogram(
    "weir_worker_kv_transfer_seconds",
    "Time to serve or pull one KV transfer, by direction and transport",
    ["worker", "direction", "transport"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
KV_RECORDS_REFUSED = Counter(
    "weir_worker_kv_records_refused",
    "Pulls that stopped at a record they refused, by reason (oversized, surplus)",
    ["worker", "reason"],
)

_PER_WORKER = (IN_FLIGHT, DRAINING, WAITING, KV_BLOCKS_USED, KV_BLOCKS_TOTAL)


def observe_load(load: LoadReport, in_flight: int) -> None:
    IN_FLIGHT.labels(load.worker_id).set(in_flight)
    WAITING.labels(load.worker_id).set(load.waiting_requests)
    KV_BLOCKS_USED.labels(load.worker_id).set(load.active_blocks)
    KV_BLOCKS_TOTAL.labels(load.worker_id).set(load.total_blocks)


def observe_transfer(
    worker: str, direction: str, transport: str, outcome: str, size: int, seconds: float
) -> None:
    KV_TRANSFERS.labels(worker, direction, outcome).inc()
    KV_TRANSFER_BYTES.labels(worker, direction, transport).inc(size)
    KV_TRANSFER_SECONDS.labels(worker, direction, transport).observe(seconds)


def forget(worker_id: str) -> None:
    """Drop a stopped worker's gauges (counters stay: they are totals)."""
    for gauge in _PER_WORKER:
        with contextlib.suppress(KeyError):
            gauge.remove(worker_id)
