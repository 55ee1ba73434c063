from __future__ import annotations

from collections.abc import Mapping

from router.protocols import Decision, RouteRequest, WorkerLoad


class LeastLoadedPolicy:
    """Fewest requests (reported or in flight), then fewest active KV blocks, then worker id."""

    def select(self, request: RouteRequest, workers: Mapping[str, WorkerLoad]) -> Decision:
        def key(worker_id: str) -> tuple[int, int, str]:
            load = workers[worker_id]
            return (load.requests, load.blocks, worker_id)

        return Decision(min(workers, key=key))
