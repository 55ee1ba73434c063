"""`weir frontend`: the OpenAI-compatible HTTP frontend in cluster mode.

It finds workers in etcd (each bound to a lease, so a dead worker disappears within its TTL),
reads their KV events and load reports from NATS, and calls them over the TCP request plane.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
from collections.abc import Callable, Mapping

from orchestrator.cli.options import (
    add_cluster_planes,
    add_disaggregation_arguments,
    add_log_level,
    add_plane_security,
    add_router_arguments,
    disagg_policy,
    env_default,
    plane_security,
    router_params,
    run_until_stopped,
    setup_logging,
)
from orchestrator.cli.processes import MAX_DEFAULT_PROCESSES, Supervisor, default_processes
from orchestrator.frontend.config import REMOTE_FALLBACK_MODE, ROUTER_MODES, FrontendConfig
from orchestrator.frontend.server import FrontendServer, create_app
from orchestrator.frontend.shared_port import reserve
from orchestrator.runtime.discovery import Discovery, make_discovery
from orchestrator.runtime.events import EventPlane, make_event_plane
from orchestrator.runtime.request_plane import PlaneSecurity, WorkerClient
from orchestrator.runtime.urls import redacted

_DEFAULTS = FrontendConfig()


def add_frontend_arguments(parser: argparse.ArgumentParser, default_port: int = 8000) -> None:
    """HTTP and routing flags, shared with `weir serve`."""
    http = parser.add_argument_group("HTTP")
    http.add_argument(
        "--host",
        default=env_default("WEIR_HOST", "127.0.0.1"),
        help="address to listen on; 0.0.0.0 for all interfaces (env WEIR_HOST; default 127.0.0.1)",
    )
    http.add_argument(
        "--port",
        type=int,
        default=env_default("WEIR_PORT", default_port, int),
        help=f"HTTP port (env WEIR_PORT; default {default_port})",
    )
    http.add_argument(
        "--probe-port",
        type=int,
        default=env_default("WEIR_PROBE_PORT", None, int),
        help="also answer /health and /live on this port, from a thread, so probes get an answer "
        "while the event loop is saturated (env WEIR_PROBE_PORT; default: off)",
    )
    http.add_argument(
        "--request-timeout",
        type=float,
        default=_DEFAULTS.request_timeout_s,
        metavar="SECONDS",
        help=f"wall-clock limit per request (default {_DEFAULTS.request_timeout_s:g})",
    )
    http.add_argument(
        "--migration-limit",
        type=int,
        default=_DEFAULTS.migration_limit,
        metavar="N",
        help="times one request may move to another worker when its worker fails (connection lost "
        "or refused, or the worker overloaded), continuing after the tokens already streamed; "
        f"0 disables (default {_DEFAULTS.migration_limit})",
    )
    http.add_argument(
        "--read-timeout",
        type=float,
        default=_DEFAULTS.read_timeout_s,
        metavar="SECONDS",
        help="a request's headers, then its body, must each arrive within this; slower "
        f"connections are closed (default {_DEFAULTS.read_timeout_s:g})",
    )
    http.add_argument(
        "--max-connections",
        type=int,
        default=_DEFAULTS.max_connections,
        help=f"open HTTP connections beyond this are closed at once (default {_DEFAULTS.max_connections})",
    )
    http.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=_DEFAULTS.stream_stall_timeout_s,
        metavar="SECONDS",
        help="cancel a response whose client has read nothing for this long "
        f"(default {_DEFAULTS.stream_stall_timeout_s:g})",
    )
    http.add_argument(
        "--stream-backlog-bytes",
        type=int,
        default=_DEFAULTS.stream_backlog_bytes,
        metavar="BYTES",
        help="cancel a stream whose client has fallen this many bytes of tokens behind its worker "
        f"(default {_DEFAULTS.stream_backlog_bytes})",
    )
    http.add_argument(
        "--max-stop-strings",
        type=int,
        default=_DEFAULTS.max_stop_strings,
        help=f"most stop strings one request may give (default {_DEFAULTS.max_stop_strings})",
    )
    http.add_argument(
        "--api-key",
        default=env_default("WEIR_API_KEY"),
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health, /live and /metrics "
        "(env WEIR_API_KEY, better than the flag, which other users see in the process list; "
        "default: no key)",
    )
    http.add_argument(
        "--drain-timeout",
        type=float,
        default=_DEFAULTS.drain_timeout_s,
        metavar="SECONDS",
        help="on SIGTERM, how long in-flight requests may take to finish; the rest then end with "
        f"an error event (streams) or a 503 (default {_DEFAULTS.drain_timeout_s:g})",
    )
    _add_admission_arguments(parser)
    routing = add_router_arguments(parser, ROUTER_MODES, _DEFAULTS.router_mode)
    add_disaggregation_arguments(routing, "for a model with prefill and decode workers")
    routing.add_argument(
        "--router-address",
        default=env_default("WEIR_ROUTER_ADDRESS"),
        metavar="HOST:PORT",
        help="remote mode: the request-plane address of a standalone `weir router`; while it cannot "
        f"be reached the frontend routes {REMOTE_FALLBACK_MODE} by itself (env WEIR_ROUTER_ADDRESS)",
    )


def _add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "admission control", "requests wait in a bounded queue per model while every worker is busy"
    )
    group.add_argument(
        "--active-decode-blocks-threshold",
        type=float,
        default=_DEFAULTS.active_decode_blocks_threshold,
        metavar="FRACTION",
        help="a worker with this fraction of its KV blocks in use is busy (default: off)",
    )
    group.add_argument(
        "--active-prefill-tokens-threshold",
        type=int,
        default=_DEFAULTS.active_prefill_tokens_threshold,
        metavar="TOKENS",
        help="a worker with this many prompt tokens waiting for prefill is busy (default: off)",
    )
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=_DEFAULTS.max_queued_requests,
        help="requests that may wait per model while all its workers are busy; more get 429 "
        f"(default {_DEFAULTS.max_queued_requests})",
    )
    group.add_argument(
        "--max-queue-wait",
        type=float,
        default=_DEFAULTS.max_queue_wait_s,
        metavar="SECONDS",
        help=f"longest wait for admission before 429 (default {_DEFAULTS.max_queue_wait_s:g})",
    )


def frontend_config(
    args: argparse.Namespace, namespace: str, request_plane: PlaneSecurity | None = None
) -> FrontendConfig:
    """`request_plane`: how to dial workers (`weir serve` calls its own in process: none)."""
    request_plane = request_plane or PlaneSecurity()
    try:
        return FrontendConfig(
            host=args.host,
            port=args.port,
            probe_port=args.probe_port,
            namespace=namespace,
            router_mode=args.router_mode,
            router_params=router_params(args),
            router_address=args.router_address,
            disaggregation=disagg_policy(args),
            request_timeout_s=args.request_timeout,
            migration_limit=args.migration_limit,
            drain_timeout_s=args.drain_timeout,
            active_decode_blocks_threshold=args.active_decode_blocks_threshold,
            active_prefill_tokens_threshold=args.active_prefill_tokens_threshold,
            max_queued_requests=args.max_queued_requests,
            max_queue_wait_s=args.max_queue_wait,
            read_timeout_s=args.read_timeout,
            max_connections=args.max_connections,
            stream_stall_timeout_s=args.stream_stall_timeout,
            stream_backlog_bytes=args.stream_backlog_bytes,
            max_stop_strings=args.max_stop_strings,
            log_level=args.log_level,
            api_key=args.api_key,
            request_plane=request_plane,
        )
    except ValueError as exc:
        raise SystemExit(f"weir: {exc}") from exc


def register(parser: argparse.ArgumentParser) -> None:
    add_frontend_arguments(parser)
    parser.add_argument(
        "--processes",
        type=_processes,
        default=default_processes(),
        metavar="N",
        help="frontend processes sharing the port, each a whole frontend with its own router "
        "replica; one process serves what one core can (default: one per usable core, at most "
        f"{MAX_DEFAULT_PROCESSES}; here {default_processes()})",
    )
    add_cluster_planes(parser)
    add_plane_security(parser, serving=False)
    add_log_level(parser)
    parser.set_defaults(run=run)


def _processes(value: str) -> int:
    count = int(value)
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {count}")
    return count


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    config = frontend_config(args, args.namespace, plane_security(args, serving=False))
    if args.processes == 1:
        return run_until_stopped(lambda stop: _serve(config, args, stop, _banner(args)))
    return _supervise(config, args)


def _banner(args: argparse.Namespace, processes: str = "") -> Callable[[str], None]:
    def announce(url: str) -> None:
        planes = f"etcd {redacted(args.etcd)}, nats {redacted(args.nats)}"
        print(f"weir frontend on {url} ({processes}{planes})", flush=True)

    return announce


def _supervise(config: FrontendConfig, args: argparse.Namespace) -> int:
    """`--processes N`: children bind the ports the supervisor reserves (processes.py)."""
    try:
        held = [reserve(config.host, config.port)]
        if config.probe_port is not None:
            held.append(reserve(config.host, config.probe_port))
    except OSError as exc:
        raise SystemExit(f"weir: cannot listen on {config.host}: {exc}") from exc
    with contextlib.ExitStack() as stack:
        for sock in held:
            stack.enter_context(sock)
        ports = [sock.getsockname()[1] for sock in held]
        child = argparse.Namespace(**vars(args))
        child.port = ports[0]
        child.probe_port = ports[1] if len(ports) > 1 else None
        supervisor = Supervisor(_serve_child, child, args.processes, config.drain_timeout_s)
        announce = _banner(args, f"{args.processes} processes, ")
        return supervisor.run(lambda: announce(f"http://{config.host}:{ports[0]}"))


def _serve_child(args: argparse.Namespace, ready: Callable[[], None]) -> None:
    """One of the supervisor's processes: a whole frontend on the shared port."""
    setup_logging(args.log_level)
    config = frontend_config(args, args.namespace, plane_security(args, serving=False))
    config = dataclasses.replace(config, reuse_port=True)
    sys.exit(run_until_stopped(lambda stop: _serve(config, args, stop, lambda url: ready())))


async def _serve(
    config: FrontendConfig, args: argparse.Namespace, stop: asyncio.Event, on_listening: Callable[[str], None]
) -> None:
    discovery = make_discovery(args.etcd, args.namespace)
    events = make_event_plane(args.nats)
    try:
        await serve_http(config, discovery, events, stop, on_listening=on_listening)
    finally:
        await asyncio.gather(discovery.close(), events.close(), return_exceptions=True)


async def serve_http(
    config: FrontendConfig,
    discovery: Discovery,
    events: EventPlane,
    stop: asyncio.Event,
    local_workers: Mapping[str, WorkerClient] | None = None,
    on_listening: Callable[[str], None] = lambda url: print(f"weir frontend on {url}", flush=True),
) -> None:
    """Serve HTTP until SIGINT/SIGTERM or `stop` (in-flight requests get --drain-timeout to
    finish first), calling `on_listening(url)` once the socket is bound, which prints the
    ready line: with --port 0 the line is how a caller learns the port."""
    server = FrontendServer(create_app(config, discovery, events, local_workers), config)
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    # A signal during start-up may close the listener before this loop looks at it.
    listening = [sock for srv in server.servers for sock in srv.sockets]
    if server.started and listening:
        on_listening(f"http://{config.host}:{listening[0].getsockname()[1]}")
    # A signal that arrived before uvicorn installed its handlers only set `stop`.
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    stopping.cancel()
    await serving
