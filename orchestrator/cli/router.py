"""`weir router`: the KV-aware router as its own process.

It follows the workers in etcd, reads their KV events and load reports from NATS, and
answers `route` / `finish` calls on the TCP request plane (`router.service.RouterService`)
for frontends started with `--router-mode remote --router-address HOST:PORT`. It registers
itself in discovery as a `router` instance; `--metrics-port` serves /live, /health, /metrics.
"""

from __future__ import annotations

import argparse
import asyncio

from orchestrator.cli.options import (
    add_cluster_planes,
    add_log_level,
    add_router_arguments,
    add_service_arguments,
    plane_security,
    router_params,
    run_until_stopped,
    setup_logging,
)
from orchestrator.runtime.discovery import make_discovery
from orchestrator.runtime.events import make_event_plane
from orchestrator.runtime.health import HealthServer
from router.router import MODES
from router.service import RouterService

DEFAULT_PORT = 9100


def register(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser, "router", "WEIR_ROUTER", DEFAULT_PORT)
    add_router_arguments(parser, MODES, "kv")
    add_cluster_planes(parser)
    add_log_level(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    return run_until_stopped(lambda stop: _serve(args, stop))


async def _serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    security = plane_security(args, serving=True)
    discovery = make_discovery(args.etcd, args.namespace, ttl=args.lease_ttl)
    events = make_event_plane(args.nats)
    try:
        service = RouterService(
            discovery,
            events,
            args.namespace,
            args.router_mode,
            router_params(args),
            host=args.host,
            port=args.port,
            advertise_host=args.advertise_host,
            instance_id=args.instance_id,
            security=security,
        )
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"weir router: {exc}") from exc
    health = HealthServer(lambda: service.ready)
    try:
        if args.metrics_port is not None:
            await health.start("0.0.0.0", args.metrics_port)
        await service.start()
        print(f"weir router {service.instance_id}: {args.router_mode} at {service.address}", flush=True)
        await stop.wait()
    finally:
        await service.stop()
        await health.stop()
        await asyncio.gather(discovery.close(), events.close(), return_exceptions=True)
