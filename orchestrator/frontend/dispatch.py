"""Send one worker request and stream its deltas back, with routing, one retry and cleanup.

A retryable failure (worker gone, connection lost, worker overloaded) before the first delta
arrived is retried on another worker; after that the client has seen output, so the error is
surfaced. Whatever happens, the router hears `on_finish` and the worker stream is closed,
which sends the worker a cancel frame if it is still generating."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator

from orchestrator.frontend.metrics import Metrics
from orchestrator.frontend.registry import ModelEntry
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import TokenDelta, WorkerRequest
from router.protocols import RouteRequest

log = logging.getLogger("weir.frontend")


async def generate(
    entry: ModelEntry, request: WorkerRequest, route: RouteRequest, max_retries: int, metrics: Metrics
) -> AsyncGenerator[TokenDelta, None]:
    routes = entry.routes
    failed: list[str] = []
    while True:
        worker_id = (await routes.select(route, failed)).worker_id
        stream = routes.workers[worker_id].generate(request)
        streamed = False
        try:
            async for delta in stream:
                streamed = True
                yield delta
            return
        except EngineError as exc:
            if streamed or not exc.retryable or len(failed) >= max_retries:
                raise
            log.warning(
                "request %s failed on %s (%s); retrying elsewhere", request.request_id, worker_id, exc
            )
            metrics.retries.inc()
            failed.append(worker_id)
        finally:
            await stream.aclose()
            routes.on_finish(worker_id, route.request_id)
