"""Send one worker request and stream its deltas back, with routing, migration and cleanup.

Request migration (NVIDIA Dynamo's `--migration-limit`): when a worker's stream fails with a
retryable error (its connection refused, lost or reset: `unavailable`; or it refused the
request: `overloaded`), the request goes to another worker with the tokens already streamed
in `generated_token_ids`, and the caller's stream goes on from there, no gap and no repeat.
A failure before the first token is the same thing with nothing generated. At most
`migration_limit` times per request; past that, or for an error that is not retryable, the
error reaches the caller.

A refused or lost connection also trips the worker's circuit breaker (router/table.py), so
other requests stop choosing it at once; the first delta from a worker closes its breaker.
Whatever happens, the router hears `on_finish` and the worker stream is closed, which sends
the worker a cancel frame if it is still generating."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator

import msgspec

from orchestrator.frontend.registry import ModelEntry
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import TokenDelta, WorkerRequest
from router.protocols import RouteRequest

log = logging.getLogger("weir.frontend")


async def generate(
    entry: ModelEntry, request: WorkerRequest, route: RouteRequest, migration_limit: int
) -> AsyncGenerator[TokenDelta, None]:
    routes = entry.routes
    failed: list[str] = []
    generated: list[int] = []
    # The prompt's cached tokens as the worker that streamed first reported them; a worker the
    # request migrated to finds prompt + generated tokens in its cache, which is not that figure.
    cached = 0
    attempt = request
    while True:
        worker_id = (await routes.select(route, failed)).worker_id
        resumed = bool(generated)
        stream = routes.workers[worker_id].generate(attempt)
        first = True
        try:
            async for delta in stream:
                if first:
                    first = False
                    routes.restore(worker_id)
                if resumed:
                    delta = _continued(delta, cached)
                elif delta.cached_tokens is not None:
                    cached = delta.cached_tokens
                generated += delta.token_ids
                yield delta
            return
        except EngineError as exc:
            if exc.code == "unavailable" and routes.trip(worker_id):
                entry.metrics.breaker_trips.inc()
            if not exc.retryable or len(failed) >= migration_limit:
                raise
            log.warning(
                "request %s failed on %s after %d tokens (%s); migrating it",
                request.request_id,
                worker_id,
                len(generated),
                exc,
            )
            entry.metrics.migrated(exc.code)
            failed.append(worker_id)
            if generated:
                attempt, route = _resumed(request, route, generated, entry.card.block_size)
        finally:
            await stream.aclose()
            routes.on_finish(worker_id, request.request_id)


def _resumed(
    request: WorkerRequest, route: RouteRequest, generated: list[int], block_size: int
) -> tuple[WorkerRequest, RouteRequest]:
    """The request continued after `generated`, its block hashes covering them too: the router
    then finds the worker that cached the most of prompt + output, and the worker reuses it."""
    known = request.block_hashes
    tokens = [*request.token_ids, *generated]
    hashes = known + block_hashes(
        tokens[len(known) * block_size :], block_size, request.cache_salt, known[-1] if known else None
    )
    attempt = msgspec.structs.replace(request, generated_token_ids=list(generated), block_hashes=hashes)
    return attempt, RouteRequest(request.request_id, len(tokens), hashes, route.pinned_worker)


def _continued(delta: TokenDelta, cached: int) -> TokenDelta:
    """A migrated request's delta as the caller's one stream would have had it: the prompt's
    cached tokens stay what the first worker reported."""
    usage = delta.usage
    if usage is not None:
        usage = msgspec.structs.replace(usage, cached_tokens=cached)
    return msgspec.structs.replace(delta, cached_tokens=None, usage=usage)
