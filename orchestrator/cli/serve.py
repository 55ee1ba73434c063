"""`weir serve`: the whole system in one process, with no etcd, no NATS and no GPU required.

The frontend and --workers local engine workers share an in-process discovery registry and
event plane, and the frontend calls the workers' hosts directly rather than over TCP. Everything
else (preprocessing, routing, KV events, load reports) is the code cluster mode runs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from backends.registry import add_backend_arguments, make_engine, resolve_model, served_name
from orchestrator.cli.frontend import add_frontend_arguments, frontend_config, serve_http
from orchestrator.cli.options import add_log_level, env_default, run_until_stopped, setup_logging
from orchestrator.frontend.config import FrontendConfig
from orchestrator.runtime.discovery import MemoryDiscovery
from orchestrator.runtime.engine import Engine
from orchestrator.runtime.events import MemoryEventPlane
from orchestrator.runtime.worker_host import WorkerHost

NAMESPACE = "local"


def register(parser: argparse.ArgumentParser) -> None:
    add_frontend_arguments(parser)
    parser.add_argument(
        "--workers",
        type=int,
        default=env_default("WEIR_WORKERS", 1, int),
        help="local engine workers behind the frontend (env WEIR_WORKERS; default 1)",
    )
    add_backend_arguments(parser)
    add_log_level(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if args.workers < 1:
        print("weir serve: --workers must be at least 1", file=sys.stderr)
        return 2
    if args.router_mode == "remote":  # a standalone router finds workers in etcd, not in here
        print(
            "weir serve: --router-mode remote needs a cluster (weir router, weir frontend)", file=sys.stderr
        )
        return 2
    config = frontend_config(args, NAMESPACE)
    try:
        model_dir = resolve_model(args.model)
        engines = [make_engine(args, model_dir) for _ in range(args.workers)]
    except (ValueError, OSError) as exc:
        print(f"weir serve: {exc}", file=sys.stderr)
        return 2
    return run_until_stopped(lambda stop: _serve(args, config, engines, model_dir, stop))


async def _serve(
    args: argparse.Namespace,
    config: FrontendConfig,
    engines: list[Engine],
    model_dir: Path,
    stop: asyncio.Event,
) -> None:
    discovery = MemoryDiscovery(NAMESPACE)
    events = MemoryEventPlane()
    hosts = [
        WorkerHost(engine, discovery, events, NAMESPACE, instance_id=f"worker-{i}")
        for i, engine in enumerate(engines)
    ]
    try:
        # Engines load before the frontend listens, so the first request finds a worker.
        await asyncio.gather(*(host.start() for host in hosts))
        if stop.is_set():
            return
        # The frontend calls the hosts directly: drain, metrics and all, without the TCP hop.
        local = {host.instance_id: host for host in hosts}
        model = served_name(args, model_dir)
        await serve_http(
            config,
            discovery,
            events,
            stop,
            local,
            # The worker addresses are what `weir bench --direct` dials to measure the engine
            # with no frontend in front of it.
            banner=lambda url: (
                f"weir serving {model} ({args.workers} {args.backend} worker"
                f"{'s' if args.workers > 1 else ''} at {', '.join(h.address for h in hosts)}) on {url}"
            ),
        )
    finally:
        await asyncio.gather(*(host.stop() for host in hosts), return_exceptions=True)
        await asyncio.gather(discovery.close(), events.close(), return_exceptions=True)
