"""Running the frontend: wire discovery, the request plane and uvicorn (uvloop + httptools)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping

import uvicorn
from fastapi import FastAPI

from orchestrator.frontend.app import build_app
from orchestrator.frontend.config import FrontendConfig
from orchestrator.frontend.http_guard import guarded_protocol
from orchestrator.frontend.registry import ClientFactory
from orchestrator.frontend.shared_port import listen_shared
from orchestrator.runtime.discovery import Discovery
from orchestrator.runtime.events import EventPlane
from orchestrator.runtime.protocol import Instance
from orchestrator.runtime.request_plane import (
    RequestPlaneClient,
    TcpWorkerClient,
    WorkerClient,
)


def make_client_factory(
    plane: RequestPlaneClient, local_workers: Mapping[str, WorkerClient] | None = None
) -> ClientFactory:
    """In-process workers (by instance id) are called directly; the rest over TCP."""
    local = dict(local_workers or {})

    def client_for(instance: Instance) -> WorkerClient:
        found = local.get(instance.instance_id)
        return found if found is not None else TcpWorkerClient(plane, instance.address)

    return client_for


def create_app(
    config: FrontendConfig,
    discovery: Discovery,
    events: EventPlane | None = None,
    local_workers: Mapping[str, WorkerClient] | None = None,
) -> FastAPI:
    """The app with its own request-plane client (closed with the app)."""
    plane = RequestPlaneClient(security=config.request_plane, max_backlog_bytes=config.stream_backlog_bytes)
    app = build_app(config, discovery, make_client_factory(plane, local_workers), events)
    app.state.frontend.on_close.append(plane.close)
    return app


def uvicorn_config(app: FastAPI, config: FrontendConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http=guarded_protocol(config.max_connections, config.read_timeout_s),  # httptools
        lifespan="on",
        access_log=False,  # one line per request costs real CPU at thousands of requests/s
        log_level=config.log_level,
        # FrontendServer has drained the generation routes already; this bounds the rest.
        timeout_graceful_shutdown=5,
    )


class FrontendServer(uvicorn.Server):
    """uvicorn that drains before it shuts down (drain.py): stop listening, fail readiness,
    give in-flight requests `drain_timeout_s`, end the rest with an error. uvicorn's own
    graceful shutdown would cancel them after a fixed timeout, cutting streams mid-way."""

    def __init__(self, app: FastAPI, config: FrontendConfig) -> None:
        super().__init__(uvicorn_config(app, config))
        self.drain = app.state.frontend.drain
        self.drain_timeout_s = config.drain_timeout_s
        self.reuse_port = config.reuse_port

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is None and self.reuse_port:
            sockets = [listen_shared(self.config.host, self.config.port)]
        await super().serve(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.drain.begin()
        for server in self.servers:
            server.close()  # no new connections; uvicorn closes them again, harmlessly
        await self.drain.wait(self.drain_timeout_s)
        await super().shutdown(sockets)


async def run_frontend(
    config: FrontendConfig,
    discovery: Discovery,
    events: EventPlane | None = None,
    local_workers: Mapping[str, WorkerClient] | None = None,
) -> None:
    """Serve until the process is asked to stop (SIGINT/SIGTERM, handled by uvicorn).

    Runs on the caller's event loop: start it with `uvloop.run(run_frontend(...))`."""
    logging.getLogger("weir.frontend").setLevel(config.log_level.upper())
    server = FrontendServer(create_app(config, discovery, events, local_workers), config)
    await server.serve()
