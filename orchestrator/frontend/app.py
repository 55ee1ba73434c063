"""The FastAPI app: state created once, thin routes, one error mapping, /openapi.json.

`/v1/chat/completions` and `/v1/completions` are plain-ASGI endpoints (`GenerationRoute`): they
stream with direct ASGI sends and cancel the request when the client hangs up. The other
routes are ordinary FastAPI handlers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.routing import Route

from orchestrator.frontend.asgi import (
    DONE_EVENT,
    ClientGone,
    Exchange,
    Receive,
    Scope,
    Send,
    StreamStalled,
    read_body,
)
from orchestrator.frontend.auth import ApiKeyMiddleware
from orchestrator.frontend.config import FrontendConfig
from orchestrator.frontend.drain import Drain
from orchestrator.frontend.errors import (
    BodyTimeout,
    FrontendError,
    InvalidRequest,
    ShuttingDown,
    error_body,
    to_frontend_error,
)
from orchestrator.frontend.http_guard import ABORT_EXTENSION, CHUNK_WRITER_EXTENSION
from orchestrator.frontend.metrics import Metrics
from orchestrator.frontend.openapi import WeirApp
from orchestrator.frontend.probes import ProbeServer
from orchestrator.frontend.registry import ClientFactory, ModelRegistry
from orchestrator.frontend.responses import ModelInfo, ModelList
from orchestrator.frontend.serving import Serving
from orchestrator.runtime.discovery import Discovery
from orchestrator.runtime.events import EventPlane

log = logging.getLogger("weir.frontend")

# How long the frontend waits, before it listens, for the workers registered at its start to
# be routable (their models loaded), so that its first /v1/models lists them.
STARTUP_WORKERS_WAIT_S = 60.0
Endpoint = Literal["chat", "completions"]
_CLIENT_CLOSED = 499  # nginx's status for a client that hung up; only ever counted, never sent


@dataclass(slots=True)
class FrontendState:
    config: FrontendConfig
    metrics: Metrics
    registry: ModelRegistry
    serving: Serving
    on_close: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    drain: Drain = field(default_factory=Drain)


class GenerationRoute:
    """A plain-ASGI endpoint around one `Serving` method."""

    def __init__(self, state: FrontendState, endpoint: Endpoint) -> None:
        self.state = state
        self.endpoint = endpoint
        self.handler = state.serving.chat if endpoint == "chat" else state.serving.completions
        self.inflight = state.metrics.inflight_by_endpoint[endpoint]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self.state.metrics
        extensions = scope.get("extensions", {})
        ex = Exchange(
            send,
            self.state.config.stream_stall_timeout_s,
            extensions.get(ABORT_EXTENSION),
            extensions.get(CHUNK_WRITER_EXTENSION),
        )
        drain = self.state.drain
        task = asyncio.current_task()
        assert task is not None  # uvicorn runs each request in a task of its own
        drain.track(task)
        self.inflight.inc()
        try:
            if drain.draining:
                raise ShuttingDown
            config = self.state.config
            try:
                # No trickled bodies forever.
                async with asyncio.timeout(min(config.read_timeout_s, config.request_timeout_s)):
                    body = await read_body(scope, receive, config.max_body_bytes)
            except TimeoutError:
                raise BodyTimeout from None
            ex.watch_disconnect(receive)
            await self.handler(body, ex)
        except asyncio.CancelledError:
            # Our own cancellations (the watcher's: the client is gone; the drain's: the server
            # is stopping) end the request here; any other is the server's and propagates.
            if not ex.disconnected and task not in drain.cut_tasks:
                raise
            task.uncancel()
            if ex.disconnected:
                ex.status = _CLIENT_CLOSED
                metrics.disconnects.inc()
            else:
                await self._fail(ex, ShuttingDown())
        except (ClientGone, StreamStalled):
            ex.status = _CLIENT_CLOSED
            metrics.disconnects.inc()
        except Exception as exc:
            await self._fail(ex, to_frontend_error(exc))
        finally:
            await ex.close()
            self.inflight.dec()
            drain.untrack(task)
            metrics.request_done(self.endpoint, ex.status)

    async def _fail(self, ex: Exchange, err: FrontendError) -> None:
        self.state.metrics.errors.labels(err.type).inc()
        if not ex.started:
            await ex.json(err.status, error_body(err), err.headers)
            return
        # Mid-stream the 200 is sent already: report the error in the stream, and count the
        # request by the status its error maps to, not as the success its header claimed.
        ex.status = err.status
        if not ex.finished:
            await ex.finish(b"data: " + error_body(err) + b"\n\n" + DONE_EVENT)


async def _catch_up(registry: ModelRegistry, discovery: Discovery, follower: asyncio.Task[None]) -> None:
    """Wait, boundedly, for the workers registered now to be routable. After a slow model, a
    discovery outage or a follower that failed, the frontend listens anyway (the follower,
    if alive, goes on), and says so."""
    caught_up = asyncio.create_task(registry.caught_up(discovery), name="weir-frontend-catch-up")
    done, _ = await asyncio.wait(
        {follower, caught_up}, timeout=STARTUP_WORKERS_WAIT_S, return_when=asyncio.FIRST_COMPLETED
    )
    if caught_up in done and caught_up.exception() is None:
        return
    caught_up.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await caught_up
    log.warning("listening before every registered worker is routable")


def build_app(
    config: FrontendConfig,
    discovery: Discovery,
    client_factory: ClientFactory,
    events: EventPlane | None = None,
) -> FastAPI:
    """The frontend app. Its lifespan follows `discovery` for workers; `client_factory` makes
    the client for each discovered worker (see server.make_client_factory)."""
    metrics = Metrics()
    registry = ModelRegistry(config, client_factory, events, metrics)
    serving = Serving(config, registry, metrics)
    state = FrontendState(config, metrics, registry, serving, on_close=[serving.bodies.close])

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        follower = asyncio.create_task(registry.follow(discovery), name="weir-frontend-discovery")
        await _catch_up(registry, discovery, follower)
        if config.probe_port is not None:
            probes = ProbeServer(
                config.host,
                config.probe_port,
                {"/health": partial(_health, state), "/live": _live},
                reuse_port=config.reuse_port,
            )
            probes.start()
            state.on_close.append(probes.stop)
        try:
            yield
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
            await registry.close()
            for close in state.on_close:
                await close()

    app = WeirApp(
        title="Weir", lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json"
    )
    app.state.frontend = state
    app.router.routes.append(Route("/v1/chat/completions", GenerationRoute(state, "chat"), methods=["POST"]))
    app.router.routes.append(
        Route("/v1/completions", GenerationRoute(state, "completions"), methods=["POST"])
    )
    _add_routes(app, state)
    _add_error_handlers(app)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    return app


def _health(state: FrontendState) -> tuple[int, bytes]:
    """/health's answer. Also called on the probe thread (probes.py): reads attributes only."""
    workers = state.registry.worker_count
    # Draining fails readiness first, so load balancers stop sending before streams are cut.
    status = "draining" if state.drain.draining else "ok" if workers else "no workers"
    return 200 if status == "ok" else 503, msgspec.json.encode({"status": status, "workers": workers})


def _live() -> tuple[int, bytes]:
    return 200, b'{"status":"ok"}'


def _add_routes(app: FastAPI, state: FrontendState) -> None:
    @app.get("/v1/models")
    async def models() -> Response:
        data = [ModelInfo(e.name, e.created, e.card.context_length) for e in state.registry.models.values()]
        return Response(msgspec.json.encode(ModelList(data)), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        status, body = _health(state)
        return Response(body, status_code=status, media_type="application/json")

    @app.get("/live")
    async def live() -> Response:
        status, body = _live()
        return Response(body, status_code=status, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _error_response(err: FrontendError) -> Response:
    return Response(error_body(err), status_code=err.status, media_type="application/json")


def _add_error_handlers(app: FastAPI) -> None:
    async def on_frontend_error(request: Request, exc: Exception) -> Response:
        return _error_response(to_frontend_error(exc))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        err = FrontendError(str(exc.detail), code=str(exc.status_code))
        err.status = exc.status_code
        return _error_response(err)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        return _error_response(InvalidRequest(str(exc)))

    app.add_exception_handler(FrontendError, on_frontend_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
