"""`weir worker`: one engine worker in cluster mode.

The worker serves its engine on the TCP request plane, registers its model card in etcd under
a lease (so it vanishes from every frontend within --lease-ttl seconds if it dies), and
publishes KV events and load reports on NATS. SIGTERM or SIGINT drains it: it stops taking
requests, finishes the ones in flight (up to --drain-timeout), then leaves discovery.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from backends.registry import add_backend_arguments, make_engine, resolve_model, served_name
from orchestrator.cli.options import (
    add_cluster_planes,
    add_log_level,
    add_service_arguments,
    plane_security,
    setup_logging,
)
from orchestrator.runtime.discovery import make_discovery
from orchestrator.runtime.engine import Engine
from orchestrator.runtime.events import make_event_plane
from orchestrator.runtime.worker_host import WorkerHost, serve_workers
from router.table import ROUTABLE_ROLES


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--role",
        default="aggregated",
        help=f"the worker's role; routers serve only {' | '.join(ROUTABLE_ROLES)} workers, prefill "
        "and decode are not routed yet (default aggregated)",
    )
    add_backend_arguments(parser)
    add_service_arguments(parser, "worker", "WEIR_WORKER", 0)
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="on SIGTERM, how long in-flight requests may take to finish (default 60)",
    )
    add_cluster_planes(parser)
    add_log_level(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if args.role not in ROUTABLE_ROLES:
        # A worker no router sends requests to would sit in discovery looking healthy.
        print(
            f"weir worker: --role {args.role} is not served: routers route only "
            f"{' | '.join(ROUTABLE_ROLES)} workers; prefill/decode are not routed yet",
            file=sys.stderr,
        )
        return 2
    try:
        model_dir = resolve_model(args.model)
        engine = make_engine(args, model_dir)
    except (ValueError, OSError) as exc:
        print(f"weir worker: {exc}", file=sys.stderr)
        return 2
    import uvloop

    uvloop.run(_serve(args, engine, served_name(args, model_dir)))
    return 0


async def _serve(args: argparse.Namespace, engine: Engine, model: str) -> None:
    security = plane_security(args, serving=True)
    discovery = make_discovery(args.etcd, args.namespace, ttl=args.lease_ttl)
    events = make_event_plane(args.nats)
    host = WorkerHost(
        engine,
        discovery,
        events,
        args.namespace,
        host=args.host,
        port=args.port,
        instance_id=args.instance_id,
        advertise_host=args.advertise_host,
        security=security,
    )
    try:
        started = asyncio.create_task(
            serve_workers([host], args.metrics_port, drain_timeout=args.drain_timeout)
        )
        while host.instance is None and not started.done():
            await asyncio.sleep(0.05)
        if host.instance is not None:
            where = f"{args.backend} serving {model} as {args.role} at {host.address}"
            print(f"weir worker {host.instance_id}: {where}", flush=True)
        await started
    finally:
        await asyncio.gather(discovery.close(), events.close(), return_exceptions=True)
