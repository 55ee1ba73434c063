"""Frontend settings: one dataclass, checked once at start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.runtime.request_plane import PlaneSecurity
from orchestrator.runtime.request_plane.client import DEFAULT_MAX_BACKLOG_BYTES
from router.disagg import DisaggPolicy

ROUTER_MODES = ("kv", "ttft", "round-robin", "random", "least-loaded", "remote")
# What places requests in `remote` mode while the standalone router cannot be reached.
REMOTE_FALLBACK_MODE = "least-loaded"


@dataclass(slots=True)
class FrontendConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # /health and /live also on this port, answered by a thread (probes.py) so that a kubelet
    # hears back while the event loop is saturated; None: only on `port`.
    probe_port: int | None = None
    # Bind both ports with SO_REUSEPORT, shared with sibling processes (shared_port.py); set
    # by `weir frontend --processes N` in each child, never by hand.
    reuse_port: bool = False
    namespace: str = "weir"
    # KV-aware by default; see routing.build_router for what each mode is fed.
    router_mode: str = "kv"
    # Passed through to the router factory (e.g. overlap weight and temperature for `kv`).
    router_params: dict[str, Any] = field(default_factory=dict)
    # `remote` mode: the standalone router's request-plane address ("host:port", `weir router`).
    router_address: str | None = None
    # For a model with prefill and decode workers: disaggregate never, always, or when it pays
    # (router/disagg.py).
    disaggregation: DisaggPolicy = field(default_factory=DisaggPolicy)
    # Wall-clock limit for one request, from arrival to its last token.
    request_timeout_s: float = 600.0
    # Bodies larger than this get 413 before they are read into memory.
    max_body_bytes: int = 10 * 1024 * 1024
    # A request's headers, and then its body, must each arrive within this long; a connection
    # that sends neither (slowloris) is closed (http_guard.py).
    read_timeout_s: float = 30.0
    # Open HTTP connections beyond this are closed as they arrive.
    max_connections: int = 2048
    # A stream whose client reads nothing for this long (its socket buffer full) is cancelled,
    # and its worker requests with it, rather than generating into buffers nobody drains.
    stream_stall_timeout_s: float = 30.0
    # ...and one that falls this far behind its worker's stream sooner: a stalled reader holds
    # at most this many bytes of undelivered tokens (request_plane/client.py).
    stream_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES
    # OpenAI allows 4; agent frameworks send a handful more. Each is searched in every delta.
    max_stop_strings: int = 16
    # Request migration (dispatch.py): how many times one request may move to another worker
    # after a retryable failure, continuing after the tokens already streamed. 0: never.
    migration_limit: int = 3
    # Admission control (admission.py), after NVIDIA Dynamo's busy thresholds: a worker is busy
    # when this fraction of its KV blocks is in use, or when this many prompt tokens wait for
    # prefill on it. None (the default, as in Dynamo) leaves that test off; with both off every
    # request is admitted at once and queues in the worker's scheduler, as before.
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: int | None = None
    # While every worker of a model is busy, requests wait in a FIFO of at most this many per
    # model, each for at most max_queue_wait_s; beyond either they get 429 with Retry-After.
    max_queued_requests: int = 1024
    max_queue_wait_s: float = 30.0
    # On SIGTERM, in-flight requests get this long to finish; the rest then end with an error
    # (an SSE error event and [DONE], or a 503) instead of a cut connection (drain.py).
    drain_timeout_s: float = 30.0
    log_level: str = "warning"
    # Tokenizers fetched from workers whose model directory is not on this machine
    # (tokenizer_files.py); None: $WEIR_CACHE_DIR/tokenizers, else ~/.cache/weir/tokenizers.
    tokenizer_cache_dir: str | None = None
    # When set, every route but /health, /live and /metrics needs `Authorization: Bearer <key>`
    # (auth.py). Kept out of repr so it never reaches a log line.
    api_key: str | None = field(default=None, repr=False)
    # The cluster secret and TLS for calls to workers and a standalone router.
    request_plane: PlaneSecurity = field(default_factory=PlaneSecurity)

    def __post_init__(self) -> None:
        if self.router_mode not in ROUTER_MODES:
            raise ValueError(
                f"unknown router mode {self.router_mode!r}; choose one of {', '.join(ROUTER_MODES)}"
            )
        if (self.router_mode == "remote") != bool(self.router_address):
            raise ValueError("router mode 'remote' and a router address go together")
        for name in ("port", "probe_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port < 65536:
                raise ValueError(f"{name} must be in 0..65535, got {port}")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be positive")
        if self.max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be positive")
        for name in (
            "read_timeout_s",
            "stream_stall_timeout_s",
            "stream_backlog_bytes",
            "max_connections",
            "max_stop_strings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.migration_limit < 0:
            raise ValueError("migration_limit must be >= 0")
        decode = self.active_decode_blocks_threshold
        if decode is not None and not 0 < decode <= 1:
            raise ValueError("active_decode_blocks_threshold must be in (0, 1]")
        if self.active_prefill_tokens_threshold is not None and self.active_prefill_tokens_threshold <= 0:
            raise ValueError("active_prefill_tokens_threshold must be positive")
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.max_queue_wait_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("max_queue_wait_s must be positive and drain_timeout_s >= 0")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty or blank; leave it unset to accept any request")
