"""Prometheus metrics of the router.

One `RouterMetrics` per registry: the frontend passes its app's registry so the series
appear on its /metrics; standalone uses (replay, benchmarks) share one on prometheus'
default registry. Series carry the model and mode, never a worker (their count stays fixed).
"""

from __future__ import annotations

from functools import cache

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        r = registry
        labels = ["model", "mode"]
        self.decisions = Counter("weir_router_decisions", "Requests routed", labels, registry=r)
        self.decision_seconds = Histogram(
            "weir_router_decision_seconds",
            "Time to pick a worker (index lookup, cost model, bookkeeping)",
            labels,
            buckets=(10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 5e-3, 25e-3),
            registry=r,
        )
        self.prompt_blocks = Counter(
            "weir_router_prompt_blocks", "Full prompt blocks of routed requests", labels, registry=r
        )
        self.chosen_overlap_blocks = Counter(
            "weir_router_chosen_overlap_blocks",
            "Prompt blocks cached on the chosen worker; over prompt blocks, the predicted hit rate",
            labels,
            registry=r,
        )
        self.best_overlap_blocks = Counter(
            "weir_router_best_overlap_blocks",
            "Prompt blocks cached on the best-matching worker; the hit rate routing by cache alone would get",
            labels,
            registry=r,
        )
        self.predicted_ttft = Histogram(
            "weir_router_predicted_ttft_seconds",
            "ttft mode: the chosen worker's predicted time to first token",
            labels,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        self.kv_events = Counter(
            "weir_router_kv_events_applied", "KV events applied to the index", ["model"], registry=r
        )
        self.resyncs = Counter(
            "weir_router_resyncs",
            "Worker snapshots applied, after a gap or on join",
            ["model", "reason"],
            registry=r,
        )


@cache
def default_metrics() -> RouterMetrics:
    return RouterMetrics()
