"""`weir serve`: the whole system in one process, with no etcd, no NATS and no GPU required.

The frontend and --workers local engine workers share an in-process discovery registry and
event plane, and the frontend calls the workers' hosts directly rather than over TCP. Everything
else (preprocessing, routing, KV events, load reports) is the code cluster mode runs.

--prefill-workers P --decode-workers D adds workers with those roles (disaggregated serving,
docs/router.md); they pull the prompt KV from each other over the TCP request plane, as
separate processes would. With them, --workers (aggregated) defaults to 0.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from backends.registry import add_backend_arguments, make_engine, resolve_model, served_name
from orchestrator.cli.frontend import add_frontend_arguments, frontend_config, serve_http
from orchestrator.cli.options import add_log_level, run_until_stopped, setup_logging
from orchestrator.cli.worker import with_role
from orchestrator.frontend.config import FrontendConfig
from orchestrator.runtime.discovery import MemoryDiscovery
from orchestrator.runtime.engine import Engine
from orchestrator.runtime.events import MemoryEventPlane
from orchestrator.runtime.protocol import Role
from orchestrator.runtime.worker_host import WorkerHost

NAMESPACE = "local"


def register(parser: argparse.ArgumentParser) -> None:
    add_frontend_arguments(parser)
    parser.add_argument(
        "--workers",
        type=int,
        help="local aggregated engine workers behind the frontend (default 1, or 0 with "
        "--prefill-workers or --decode-workers)",
    )
    parser.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        help="local prefill workers: they compute disaggregated requests' prompts and hand the KV "
        "to a decode worker; need --decode-workers (default 0)",
    )
    parser.add_argument(
        "--decode-workers",
        type=int,
        default=0,
        help="local decode workers: they continue disaggregated requests after the prefill's "
        "first token, and serve whole requests (default 0)",
    )
    add_backend_arguments(parser)
    add_log_level(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    roles = _roles(args)
    if isinstance(roles, str):
        print(f"weir serve: {roles}", file=sys.stderr)
        return 2
    if args.router_mode == "remote":  # a standalone router finds workers in etcd, not in here
        print(
            "weir serve: --router-mode remote needs a cluster (weir router, weir frontend)", file=sys.stderr
        )
        return 2
    config = frontend_config(args, NAMESPACE)
    try:
        model_dir = resolve_model(args.model)
        workers = {
            worker_id: with_role(make_engine(args, model_dir, role, worker_id), role)
            for worker_id, role in zip(_ids(roles), roles, strict=True)
        }
    except (ValueError, OSError) as exc:
        print(f"weir serve: {exc}", file=sys.stderr)
        return 2
    return run_until_stopped(lambda stop: _serve(args, config, workers, model_dir, stop))


def _roles(args: argparse.Namespace) -> list[Role] | str:
    """Each local worker's role, or what is wrong with the counts."""
    prefill, decode = args.prefill_workers, args.decode_workers
    aggregated = args.workers if args.workers is not None else (0 if prefill or decode else 1)
    if min(aggregated, prefill, decode) < 0:
        return "worker counts must not be negative"
    if prefill and not decode:
        return "--prefill-workers needs --decode-workers: a prefill hands its request to a decode worker"
    if aggregated + decode < 1:
        return "--workers or --decode-workers must be at least 1"
    counts: dict[Role, int] = {"aggregated": aggregated, "prefill": prefill, "decode": decode}
    return [role for role, count in counts.items() for _ in range(count)]


async def _serve(
    args: argparse.Namespace,
    config: FrontendConfig,
    engines: dict[str, Engine],
    model_dir: Path,
    stop: asyncio.Event,
) -> None:
    discovery = MemoryDiscovery(NAMESPACE)
    events = MemoryEventPlane()
    hosts = [
        WorkerHost(engine, discovery, events, NAMESPACE, instance_id=instance_id)
        for instance_id, engine in engines.items()
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
            on_listening=lambda url: print(
                f"weir serving {model} ({_described(args.backend, hosts)}) on {url}", flush=True
            ),
        )
    finally:
        await asyncio.gather(*(host.stop() for host in hosts), return_exceptions=True)
        await asyncio.gather(discovery.close(), events.close(), return_exceptions=True)


def _ids(roles: list[Role]) -> list[str]:
    """worker-0, worker-1, ... as before roles; prefill-2, decode-3 ... for the others."""
    return [f"worker-{i}" if role == "aggregated" else f"{role}-{i}" for i, role in enumerate(roles)]


def _described(backend: str, hosts: list[WorkerHost]) -> str:
    """'2 mocker workers at A, B', or by role: '1 prefill mocker worker at A, 1 decode ... at B'."""
    groups: dict[Role, list[WorkerHost]] = {}
    for host in hosts:
        groups.setdefault(host.engine.card.role, []).append(host)
    parts = []
    for role, members in groups.items():
        kind = backend if role == "aggregated" else f"{role} {backend}"
        plural = "s" if len(members) > 1 else ""
        parts.append(f"{len(members)} {kind} worker{plural} at {', '.join(h.address for h in members)}")
    return ", ".join(parts)
