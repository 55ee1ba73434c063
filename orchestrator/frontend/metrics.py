"""Prometheus metrics for the frontend, on a registry per app.

Label lookups happen once per model (`ModelMetrics`) or once per request, never per token:
the streaming path only touches pre-bound children.

Under `weir frontend --processes N` every process records into prometheus_client's
multiprocess directory (`PROMETHEUS_MULTIPROC_DIR`, set by the supervisor before the process
starts) and each one's /metrics answers for all of them: counters and histograms summed,
in-flight and queued gauges summed over live processes, the worker count their maximum."""

from __future__ import annotations

import os

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from router.metrics import RouterMetrics

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
_ENDPOINTS = ("chat", "completions")
# Why admission control turned a request away: its model's queue was full, or it waited too long.
REJECT_REASONS = ("queue_full", "queue_timeout")
# How a request of a model with prefill workers was served (dispatch.py): its prefill on a
# prefill worker, whole by the policy's choice, or whole after its prefill failed.
DISAGG_OUTCOMES = ("disaggregated", "aggregated", "fallback")


class ModelMetrics:
    """Children of the per-model series, bound once when the model appears."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.ttft = metrics.ttft.labels(model)
        self.itl = metrics.itl.labels(model)
        self.e2e = metrics.e2e.labels(model)
        self.input_tokens = metrics.input_tokens.labels(model)
        self.output_tokens = metrics.output_tokens.labels(model)
        self.cached_tokens = metrics.cached_tokens.labels(model)
        self.breaker_trips = metrics.breaker_trips.labels(model)
        self._migrations = metrics.migrations
        self._model = model
        self.queued = metrics.queued.labels(model)
        self.queue_wait = metrics.queue_wait.labels(model)
        self.rejected = {reason: metrics.rejected.labels(model, reason) for reason in REJECT_REASONS}
        self.disagg_outcomes = {o: metrics.disagg_decisions.labels(model, o) for o in DISAGG_OUTCOMES}
        self.handover = metrics.handover.labels(model)
        self._fallbacks = metrics.disagg_fallbacks

    def migrated(self, reason: str) -> None:
        # Rare (a worker failed), so the label lookup happens here, not at bind time.
        self._migrations.labels(self._model, reason).inc()

    def fell_back(self, reason: str) -> None:
        """A prefill failed before its first token (`reason`: its error code, or no_worker)."""
        self.disagg_outcomes["fallback"].inc()
        self._fallbacks.labels(self._model, reason).inc()

    def finished(self, ttft: float | None, e2e: float, prompt: int, completion: int, cached: int) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion > 1:
                # Mean time per output token after the first, once per request (vLLM's TPOT).
                self.itl.observe((e2e - ttft) / (completion - 1))
        self.e2e.observe(e2e)
        self.input_tokens.inc(prompt)
        self.output_tokens.inc(completion)
        self.cached_tokens.inc(cached)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "weir_frontend_requests", "Finished HTTP requests", ["endpoint", "status"], registry=r
        )
        self.inflight = Gauge(
            "weir_frontend_inflight_requests",
            "Requests being served",
            ["endpoint"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.errors = Counter("weir_frontend_errors", "Failed requests by error type", ["type"], registry=r)
        self.migrations = Counter(
            "weir_frontend_migrations",
            "Requests moved to another worker after a retryable failure, by the error's code",
            ["model", "reason"],
            registry=r,
        )
        self.breaker_trips = Counter(
            "weir_frontend_circuit_breaker_trips",
            "Workers left out of routing after a refused or lost connection",
            ["model"],
            registry=r,
        )
        self.disconnects = Counter(
            "weir_frontend_client_disconnects", "Requests cancelled by the client hanging up", registry=r
        )
        self.ttft = Histogram(
            "weir_frontend_time_to_first_token_seconds",
            "Time to first token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "weir_frontend_inter_token_latency_seconds",
            "Mean time between output tokens, per request",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "weir_frontend_request_duration_seconds",
            "Request latency",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.input_tokens = Counter("weir_frontend_input_tokens", "Prompt tokens", ["model"], registry=r)
        self.output_tokens = Counter("weir_frontend_output_tokens", "Generated tokens", ["model"], registry=r)
        self.cached_tokens = Counter(
            "weir_frontend_cached_tokens", "Prompt tokens served from cache", ["model"], registry=r
        )
        self.queued = Gauge(
            "weir_frontend_queued_requests",
            "Requests waiting for admission",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue_wait = Histogram(
            "weir_frontend_queue_wait_seconds",
            "Time from arrival at admission control to admission, per admitted request",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "weir_frontend_rejected_requests",
            "Requests admission control turned away with 429",
            ["model", "reason"],
            registry=r,
        )
        self.disagg_decisions = Counter(
            "weir_frontend_disagg_decisions",
            "Requests of models with prefill workers, by how they were served: disaggregated "
            "(over all three: the remote-prefill share), aggregated, or fallback",
            ["model", "outcome"],
            registry=r,
        )
        self.disagg_fallbacks = Counter(
            "weir_frontend_disagg_fallbacks",
            "Disaggregated requests served whole because their prefill failed before its first "
            "token, by the error's code (no_worker: no prefill worker could take it)",
            ["model", "reason"],
            registry=r,
        )
        self.handover = Histogram(
            "weir_frontend_disagg_handover_seconds",
            "From a prefill worker's first token to the decode worker's first token (the KV pull included)",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # Every process follows the same discovery, so each knows (about) every worker.
        self.workers = Gauge(
            "weir_frontend_workers", "Known workers", registry=r, multiprocess_mode="livemax"
        )
        self.router = RouterMetrics(r)  # shared by every model's router, labelled by model
        self.inflight_by_endpoint = {e: self.inflight.labels(e) for e in _ENDPOINTS}
        self._requests_by_label: dict[tuple[str, int], Counter] = {}

    def for_model(self, model: str) -> ModelMetrics:
        return ModelMetrics(self, model)

    def request_done(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        child = self._requests_by_label.get(key)
        if child is None:
            child = self._requests_by_label[key] = self.requests.labels(endpoint, str(status))
        child.inc()

    def render(self) -> bytes:
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory:
            every_process = CollectorRegistry()
            MultiProcessCollector(every_process, directory)
            return generate_latest(every_process)
        # Plus the process-wide registry: in `weir serve`, the embedded workers' metrics.
        return generate_latest(self.registry) + generate_latest(REGISTRY)
