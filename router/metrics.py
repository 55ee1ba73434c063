"""Prometheus metrics of the router. Created once per process (prometheus' registry is
process-wide); routers label nothing per worker, so the series count stays fixed."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

DECISIONS = Counter("weir_router_decisions_total", "Requests routed", ["mode"])
DECISION_SECONDS = Histogram(
    "weir_router_decision_seconds",
    "Time to pick a worker (index lookup, cost model, bookkeeping)",
    buckets=(10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 5e-3, 25e-3),
)
PROMPT_BLOCKS = Counter("weir_router_prompt_blocks_total", "Full prompt blocks of routed requests")
CHOSEN_OVERLAP_BLOCKS = Counter(
    "weir_router_chosen_overlap_blocks_total",
    "Prompt blocks cached on the chosen worker; over prompt blocks, the predicted hit rate",
)
BEST_OVERLAP_BLOCKS = Counter(
    "weir_router_best_overlap_blocks_total",
    "Prompt blocks cached on the best-matching worker; the hit rate routing by cache alone would get",
)
KV_EVENTS = Counter("weir_router_kv_events_applied_total", "KV events applied to the index")
RESYNCS = Counter("weir_router_resyncs_total", "Worker snapshots fetched to repair a gap or join", ["reason"])
