"""Prometheus metrics of the router.

One `RouterMetrics` per registry: the frontend passes its app's registry so the series
appear on its /metrics; standalone uses (replay, benchmarks) share one on prometheus'
default registry. Series carry the model and mode, never a worker (their count stays fixed).

The per-decision series live in plain numbers, one `DecisionStats` per (model, mode), and
become samples only when the registry is scraped: five prometheus_client calls (each a
lock and several Python calls) cost a decision more than its load bookkeeping. Routers
update them from their event loop thread alone; a scrape from another thread may see one
decision half counted, never a lost one. KV-event and resync counts change per event batch,
not per request, and stay prometheus_client Counters.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from functools import cache

from prometheus_client import REGISTRY, CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

DECISION_BUCKETS = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 5e-3, 25e-3)
LABELS = ["model", "mode"]


class DecisionStats:
    """Running totals of one (model, mode)'s decisions."""

    __slots__ = (
        "best_overlap_blocks",
        "buckets",
        "chosen_overlap_blocks",
        "decisions",
        "prompt_blocks",
        "seconds",
    )

    def __init__(self) -> None:
        self.decisions = 0
        self.prompt_blocks = 0
        self.chosen_overlap_blocks = 0
        self.best_overlap_blocks = 0
        self.seconds = 0.0
        # decisions per latency bucket, not cumulative; the last is above every bound (+Inf)
        self.buckets = [0] * (len(DECISION_BUCKETS) + 1)

    def record(self, seconds: float, prompt_blocks: int, chosen_overlap: int, best_overlap: int) -> None:
        self.decisions += 1
        self.seconds += seconds
        self.buckets[bisect_left(DECISION_BUCKETS, seconds)] += 1  # a bucket holds values <= its bound
        self.prompt_blocks += prompt_blocks
        self.chosen_overlap_blocks += chosen_overlap
        self.best_overlap_blocks += best_overlap


class RouterMetrics(Collector):
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self._stats: dict[tuple[str, str], DecisionStats] = {}
        self.kv_events = Counter(
            "weir_router_kv_events_applied", "KV events applied to the index", ["model"], registry=registry
        )
        self.resyncs = Counter(
            "weir_router_resyncs",
            "Worker snapshots applied, after a gap or on join",
            ["model", "reason"],
            registry=registry,
        )
        registry.register(self)

    def decisions(self, model: str, mode: str) -> DecisionStats:
        """The totals routers of this model and mode add their decisions to."""
        return self._stats.setdefault((model, mode), DecisionStats())

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily("weir_router_decisions", "Requests routed", labels=LABELS)
        seconds = HistogramMetricFamily(
            "weir_router_decision_seconds",
            "Time to pick a worker (index lookup, cost model, bookkeeping)",
            labels=LABELS,
        )
        prompt = CounterMetricFamily(
            "weir_router_prompt_blocks", "Full prompt blocks of routed requests", labels=LABELS
        )
        chosen = CounterMetricFamily(
            "weir_router_chosen_overlap_blocks",
            "Prompt blocks cached on the chosen worker; over prompt blocks, the predicted hit rate",
            labels=LABELS,
        )
        best = CounterMetricFamily(
            "weir_router_best_overlap_blocks",
            "Prompt blocks cached on the best-matching worker; the hit rate routing by cache alone would get",
            labels=LABELS,
        )
        for labels, stats in list(self._stats.items()):
            decisions.add_metric(labels, stats.decisions)
            cumulative, buckets = 0, []
            for bound, count in zip((*DECISION_BUCKETS, float("inf")), stats.buckets, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            seconds.add_metric(labels, buckets, stats.seconds)
            prompt.add_metric(labels, stats.prompt_blocks)
            chosen.add_metric(labels, stats.chosen_overlap_blocks)
            best.add_metric(labels, stats.best_overlap_blocks)
        yield from (decisions, seconds, prompt, chosen, best)


@cache
def default_metrics() -> RouterMetrics:
    return RouterMetrics()
