"""What the router is asked and what it answers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RouteRequest:
    """One request to place. `block_hashes` are the prompt's sequence hashes at the model
    card's block size (computed once by the preprocessor)."""

    request_id: str
    num_tokens: int
    block_hashes: list[int] = field(default_factory=list)
    pinned_worker: str | None = None  # `direct` mode


@dataclass(slots=True)
class Decision:
    worker_id: str
    overlap_blocks: int = 0  # prompt blocks the chosen worker already caches
    cost: float = 0.0


@dataclass(slots=True)
class WorkerLoad:
    """A worker's load as the router knows it: its last report plus the router's own
    in-flight requests sent to it since."""

    active_requests: int = 0
    waiting_requests: int = 0
    active_blocks: int = 0
    total_blocks: int = 0
    draining: bool = False


class NoWorkerAvailable(Exception):
    """No worker can take the request (none registered, or all filtered out)."""
