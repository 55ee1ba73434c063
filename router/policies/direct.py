from __future__ import annotations

from collections.abc import Mapping

from router.protocols import Decision, NoWorkerAvailable, RouteRequest, WorkerLoad


class DirectPolicy:
    """The caller names the worker (`RouteRequest.pinned_worker`)."""

    def select(self, request: RouteRequest, workers: Mapping[str, WorkerLoad]) -> Decision:
        if request.pinned_worker is None:
            raise NoWorkerAvailable("direct routing needs a pinned worker id")
        if request.pinned_worker not in workers:
            raise NoWorkerAvailable(f"worker {request.pinned_worker!r} is not available")
        return Decision(request.pinned_worker)
