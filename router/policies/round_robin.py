from __future__ import annotations

from collections.abc import Mapping

from router.protocols import Decision, RouteRequest, WorkerLoad


class RoundRobinPolicy:
    """Cycles through workers in id order; a joining or leaving worker shifts the cycle."""

    def __init__(self) -> None:
        self._next = 0

    def select(self, request: RouteRequest, workers: Mapping[str, WorkerLoad]) -> Decision:
        ids = sorted(workers)
        worker_id = ids[self._next % len(ids)]
        self._next += 1
        return Decision(worker_id)
