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
the worker a cancel frame if it is still generating.

Disaggregation, for a model with prefill workers (`ModelRoutes.prefill`): the policy
(router/disagg.py) decides from both pools' best candidates. A disaggregated request runs
`prefill_only` on a prefill worker, whose first token reaches the caller at once; its last
delta names the KV it holds (`kv_transfer`), and the rest runs as a migration would, on a
decode worker, with the first token in `generated_token_ids` and the transfer to pull. The
caller sees one request: the prefill's cached tokens, the decode's final usage. A prefill that
fails before its first token falls back to the whole request on a decode or aggregated worker
(not counted against the migration limit, which is about workers that already streamed); one
that fails after it migrates with that token. A first token that ends the request (a stop
token, max_tokens 1) needs no decode, and the prefill worker holds no KV for one."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Collection
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec

from orchestrator.frontend.registry import ModelEntry
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import KvTransfer, TokenDelta, WorkerRequest
from router.disagg import Choice
from router.protocols import NoWorkerAvailable, RouteRequest
from router.table import ModelRoutes

log = logging.getLogger("weir.frontend")

Deltas = AsyncGenerator[TokenDelta, None]
# A prefill failure the request itself caused: it would fail the same way anywhere else.
_NO_FALLBACK = ("invalid_request", "cancelled")


def generate(entry: ModelEntry, request: WorkerRequest, route: RouteRequest, migration_limit: int) -> Deltas:
    """The request's deltas. The disaggregation decision is taken here, before the first one;
    a model without prefill workers pays one attribute test for it."""
    prefill = entry.routes.prefill
    if prefill is not None and _decide(entry, prefill, route).disaggregate:
        return _disaggregated(entry, prefill, request, route, migration_limit)
    return _migrating(entry, request, route, migration_limit)


async def _migrating(
    entry: ModelEntry,
    request: WorkerRequest,
    route: RouteRequest,
    migration_limit: int,
    generated: list[int] | None = None,
    cached: int = 0,
    attempt: WorkerRequest | None = None,
    exclude: Collection[str] = (),
) -> Deltas:
    """`request` on whole-request workers, migrating on retryable failures. `generated`: the
    tokens the caller already has, with `cached` the prompt's cached tokens as reported with
    them; `attempt` and `exclude`: the first try when it is not `request` itself (a decode with
    its KV transfer, kept off every non-decode worker, `route` then giving no overlap credit).

    `cached` stays what the worker that streamed first reported: a worker the request migrated
    to finds prompt + generated tokens in its cache, which is not that figure."""
    routes = entry.routes
    failed: list[str] = []
    generated = [] if generated is None else generated
    if attempt is None:
        attempt = request
        if generated:
            attempt, route = _resumed(request, route, generated, entry.card.block_size)
    while True:
        try:
            worker_id = (await routes.select(route, [*exclude, *failed] if exclude else failed)).worker_id
        except NoWorkerAvailable:
            if not exclude:
                raise
            # The decode workers went away meanwhile: any whole-request worker continues it.
            exclude = ()
            attempt, route = _resumed(request, route, generated, entry.card.block_size)
            continue
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
            exclude = ()  # a decode that failed continues on any whole-request worker
            if generated:
                attempt, route = _resumed(request, route, generated, entry.card.block_size)
        finally:
            await stream.aclose()
            routes.on_finish(worker_id, request.request_id)


def _decide(entry: ModelEntry, prefill: ModelRoutes, route: RouteRequest) -> Choice:
    routes = entry.routes
    whole, best_prefill = routes.candidate(route), prefill.candidate(route)
    choice = entry.disagg.decide(whole, best_prefill, routes.decode_ready())
    if not choice.disaggregate:
        entry.metrics.disagg_outcomes["aggregated"].inc()
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "disagg %s -> %s (%s) prompt=%d whole=%s prefill=%s",
            route.request_id,
            "prefill" if choice.disaggregate else "aggregated",
            choice.reason,
            route.num_tokens,
            whole,
            best_prefill,
        )
    return choice


@dataclass(slots=True)
class _Prefill:
    """What the prefill phase leaves for the decode: the tokens it streamed, the prompt's cached
    tokens, the KV held, whether the request is done, or why it failed before a token."""

    generated: list[int] = field(default_factory=list)
    cached: int = 0
    transfer: KvTransfer | None = None
    finished: bool = False
    failure: str | None = None
    first_token_at: float = 0.0


async def _disaggregated(
    entry: ModelEntry, prefill: ModelRoutes, request: WorkerRequest, route: RouteRequest, migration_limit: int
) -> Deltas:
    state = _Prefill()
    async with aclosing(_prefill(entry, prefill, request, route, migration_limit, state)) as deltas:
        async for delta in deltas:
            yield delta
    if state.finished:
        return
    if state.failure is not None:
        log.warning("prefill of %s failed (%s); serving it whole", request.request_id, state.failure)
        entry.metrics.fell_back(state.failure)
        rest = _migrating(entry, request, route, migration_limit)
    elif entry.routes.decode_ready():
        attempt, resumed = _resumed(request, route, state.generated, entry.card.block_size)
        attempt.kv_transfer = state.transfer
        # No overlap credit: the prompt's KV arrives with the request, whichever decode worker
        # takes it; its blocks still count as that worker's load.
        decode_route = RouteRequest(request.request_id, resumed.num_tokens, [], route.pinned_worker)
        exclude = entry.routes.decode_exclude()
        rest = _migrating(
            entry, request, decode_route, migration_limit, state.generated, state.cached, attempt, exclude
        )
    else:  # no decode worker to hand over to: a whole-request worker continues after the token
        rest = _migrating(entry, request, route, migration_limit, state.generated, state.cached)
    handover = entry.metrics.handover if state.generated else None
    async with aclosing(rest) as deltas:
        async for delta in deltas:
            if handover is not None and delta.token_ids:
                handover.observe(time.perf_counter() - state.first_token_at)
                handover = None
            yield delta


async def _prefill(
    entry: ModelEntry,
    prefill: ModelRoutes,
    request: WorkerRequest,
    route: RouteRequest,
    migration_limit: int,
    state: _Prefill,
) -> Deltas:
    """The prefill phase: its tokens as the caller's first deltas (without the prefill's own
    end, unless the request ends there), and what the decode needs in `state`."""
    try:
        worker_id = (await prefill.select(route)).worker_id
    except NoWorkerAvailable:
        state.failure = "no_worker"
        return
    stream = prefill.workers[worker_id].generate(msgspec.structs.replace(request, prefill_only=True))
    try:
        async for delta in stream:
            if delta.cached_tokens is not None:
                state.cached = delta.cached_tokens
            if delta.token_ids and not state.generated:
                prefill.restore(worker_id)
                state.first_token_at = time.perf_counter()
                entry.metrics.disagg_outcomes["disaggregated"].inc()
            state.generated += delta.token_ids
            if delta.finish_reason is None:
                yield delta
                continue
            if not state.generated:  # ended without a token (aborted): nothing to hand over
                state.failure = delta.finish_reason
                return
            state.transfer = delta.kv_transfer
            state.finished = delta.finish_reason == "stop" or len(state.generated) >= request.max_tokens
            if state.finished:
                yield msgspec.structs.replace(delta, kv_transfer=None)
            elif delta.token_ids or delta.cached_tokens is not None:
                yield msgspec.structs.replace(delta, finish_reason=None, usage=None, kv_transfer=None)
    except EngineError as exc:
        if exc.code == "unavailable" and prefill.trip(worker_id):
            entry.metrics.breaker_trips.inc()
        if state.generated:
            if not exc.retryable or migration_limit == 0:
                raise
            log.warning(
                "prefill of %s failed after its first token (%s); migrating it", request.request_id, exc
            )
            entry.metrics.migrated(exc.code)
        elif exc.code in _NO_FALLBACK:
            raise
        else:
            state.failure = exc.code
    finally:
        await stream.aclose()
        prefill.on_finish(worker_id, request.request_id)


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
