"""`weir worker`: one engine worker in cluster mode.

The worker serves its engine on the TCP request plane, registers its model card in etcd under
a lease (so it vanishes from every frontend within --lease-ttl seconds if it dies), and
publishes KV events and load reports on NATS. SIGTERM or SIGINT drains it: it stops taking
requests, finishes the ones in flight (up to --drain-timeout), then leaves discovery.

`--role prefill` or `--role decode` registers the engine under that role (`WithRole`):
backends build aggregated cards, and the role is a deployment choice, not an engine
property. Frontends route a prefill worker's prefills and a decode worker's decodes (and
whole requests: it is a full engine) (docs/router.md, "Disaggregation").
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import get_args

import msgspec

from backends.registry import add_backend_arguments, make_engine, resolve_model, served_name
from orchestrator.cli.options import (
    add_cluster_planes,
    add_log_level,
    add_service_arguments,
    plane_security,
    setup_logging,
)
from orchestrator.runtime.discovery import make_discovery
from orchestrator.runtime.engine import ArrivingKv, DeltaStream, Engine
from orchestrator.runtime.events import make_event_plane
from orchestrator.runtime.kv_fabric import FABRICS, KvFabric, make_fabric
from orchestrator.runtime.protocol import KvEventBatch, KvSnapshot, LoadReport, ModelCard, Role, WorkerRequest
from orchestrator.runtime.request_plane import advertised_host
from orchestrator.runtime.worker_host import WorkerHost, default_instance_id, serve_workers

ROLES: tuple[Role, ...] = get_args(Role)


class WithRole:
    """`engine` registered under `role`: everything else is the engine's own."""

    def __init__(self, engine: Engine, role: Role) -> None:
        self.engine = engine
        self.role = role
        self._card: ModelCard | None = None  # the host reads it on every request: made once

    @property
    def card(self) -> ModelCard:
        if self._card is None:
            self._card = msgspec.structs.replace(self.engine.card, role=self.role)
        return self._card

    async def start(self) -> None:
        await self.engine.start()
        self._card = None  # an engine may complete its card as it loads (KV blocks, tiers)

    async def stop(self) -> None:
        await self.engine.stop()

    def generate(self, request: WorkerRequest, arriving_kv: ArrivingKv | None = None) -> DeltaStream:
        return self.engine.generate(request, arriving_kv)

    def read_transfer(self, transfer_id: str) -> list[bytes] | None:
        return self.engine.read_transfer(transfer_id)

    def release_transfer(self, transfer_id: str) -> None:
        self.engine.release_transfer(transfer_id)

    def load(self) -> LoadReport:
        return self.engine.load()

    def take_kv_events(self) -> list[KvEventBatch]:
        return self.engine.take_kv_events()

    def kv_snapshot(self) -> KvSnapshot:
        return self.engine.kv_snapshot()


def with_role(engine: Engine, role: Role) -> Engine:
    return engine if role == "aggregated" else WithRole(engine, role)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--role",
        choices=ROLES,
        default="aggregated",
        help="aggregated: whole requests; prefill: the prompts of disaggregated requests; decode: "
        "their continuation after a prefill worker's first token, and whole requests (default aggregated)",
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
    parser.add_argument(
        "--kv-transport",
        choices=("tcp", *FABRICS),
        default="tcp",
        help="how a decode worker on another host pulls a prefill worker's KV: tcp, the request "
        "plane's own stream; mooncake, Mooncake's transfer engine over TCP (pip install "
        "'weir[mooncake]'; its port has no secret or TLS: a network you trust), by the request "
        "plane's stream when the other worker has none. Workers on one host use shared memory "
        "either way (default tcp)",
    )
    add_cluster_planes(parser)
    add_log_level(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        fabric = None
        if args.kv_transport != "tcp":
            fabric = make_fabric(args.kv_transport, advertised_host(args.host, args.advertise_host))
        model_dir = resolve_model(args.model)
        args.instance_id = args.instance_id or default_instance_id()
        engine = with_role(make_engine(args, model_dir, args.role, args.instance_id), args.role)
    except (ValueError, OSError) as exc:
        print(f"weir worker: {exc}", file=sys.stderr)
        return 2
    import uvloop

    try:
        uvloop.run(_serve(args, engine, served_name(args, model_dir), fabric))
    finally:
        if fabric is not None:
            fabric.close()
    return 0


async def _serve(args: argparse.Namespace, engine: Engine, model: str, fabric: KvFabric | None) -> None:
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
        kv_fabric=fabric,
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
