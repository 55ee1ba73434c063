"""Flags shared by the serving commands (`serve`, `frontend`, `worker`, `router`).

Every flag that a deployment sets per environment also reads an environment variable, named
in its help text, so a container image can be configured without a command line: the flag
wins, then the variable, then the default.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from types import FrameType
from typing import Any

from orchestrator.runtime.discovery import DEFAULT_TTL

LOG_LEVELS = ("debug", "info", "warning", "error")


def env_default(name: str, default: Any = None, convert: Callable[[str], Any] = str) -> Any:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return convert(value)
    except ValueError as exc:
        raise SystemExit(f"weir: environment variable {name}={value!r} is invalid: {exc}") from exc


def add_log_level(parser: argparse.ArgumentParser, default: str = "warning") -> None:
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=env_default("WEIR_LOG_LEVEL", default),
        help=f"log verbosity (env WEIR_LOG_LEVEL; default {default})",
    )


def add_cluster_planes(parser: argparse.ArgumentParser) -> None:
    """--namespace, --etcd, --nats: where cluster-mode processes find each other."""
    group = parser.add_argument_group("cluster planes")
    group.add_argument(
        "--namespace",
        default=env_default("WEIR_NAMESPACE", "default"),
        help="weir namespace: prefix of discovery keys and event subjects "
        "(env WEIR_NAMESPACE; default 'default')",
    )
    group.add_argument(
        "--etcd",
        default=env_default("WEIR_ETCD", "http://127.0.0.1:2379"),
        help="etcd URL for discovery (env WEIR_ETCD; default http://127.0.0.1:2379)",
    )
    group.add_argument(
        "--nats",
        default=env_default("WEIR_NATS", "nats://127.0.0.1:4222"),
        help="NATS URL for KV events and load reports (env WEIR_NATS; default nats://127.0.0.1:4222)",
    )


def add_service_arguments(
    parser: argparse.ArgumentParser, what: str, env_prefix: str, default_port: int
) -> None:
    """The request-plane flags every cluster service (worker, router) takes, env vars included."""
    plane = parser.add_argument_group("request plane")
    plane.add_argument(
        "--host",
        default=env_default(f"{env_prefix}_HOST", "127.0.0.1"),
        help=f"address the request plane listens on (env {env_prefix}_HOST; default 127.0.0.1)",
    )
    plane.add_argument(
        "--port",
        type=int,
        default=env_default(f"{env_prefix}_PORT", default_port, int),
        help=f"request-plane port; 0 picks a free one (env {env_prefix}_PORT; default {default_port})",
    )
    plane.add_argument(
        "--advertise-host",
        default=env_default("WEIR_ADVERTISE_HOST"),
        help="address frontends dial, when --host is a wildcard (env WEIR_ADVERTISE_HOST; "
        "default: --host, or this host's address)",
    )
    plane.add_argument(
        "--metrics-port",
        type=int,
        default=env_default("WEIR_METRICS_PORT", None, int),
        help="serve /live, /health and /metrics on this port (env WEIR_METRICS_PORT; default: off)",
    )
    plane.add_argument(
        "--instance-id",
        default=env_default("WEIR_INSTANCE_ID"),
        help=f"this {what}'s id in discovery (env WEIR_INSTANCE_ID; default: hostname + random suffix)",
    )
    plane.add_argument(
        "--lease-ttl",
        type=float,
        default=env_default("WEIR_LEASE_TTL", DEFAULT_TTL, float),
        metavar="SECONDS",
        help=f"discovery lease: a dead {what} disappears after this long (env WEIR_LEASE_TTL; "
        f"default {DEFAULT_TTL:g})",
    )


def add_router_arguments(
    parser: argparse.ArgumentParser, modes: Sequence[str], default_mode: str
) -> argparse._ArgumentGroup:
    """--router-mode and the router's parameters (`frontend`, `serve`, `router`); returns the
    group for command-specific additions."""
    routing = parser.add_argument_group("routing")
    routing.add_argument(
        "--router-mode",
        choices=modes,
        default=env_default("WEIR_ROUTER_MODE", default_mode),
        help=f"how a worker is chosen (env WEIR_ROUTER_MODE; default {default_mode})",
    )
    routing.add_argument(
        "--kv-overlap-weight",
        type=float,
        help="kv mode: weight of prompt blocks a worker must compute against its active blocks (default 1.0)",
    )
    routing.add_argument(
        "--router-temperature",
        type=float,
        help="kv mode: 0 picks the cheapest worker; higher values sample among cheap ones (default 0)",
    )
    routing.add_argument(
        "--no-kv-events",
        action="store_true",
        help="kv mode: predict worker caches from routing decisions instead of KV events",
    )
    routing.add_argument("--router-seed", type=int, help="seed for random choices, for reproducible runs")
    return routing


def router_params(args: argparse.Namespace) -> dict[str, Any]:
    """Only what the user set, so the router's own defaults stay the single source."""
    params: dict[str, Any] = {
        "overlap_weight": args.kv_overlap_weight,
        "temperature": args.router_temperature,
        "seed": args.router_seed,
    }
    if args.no_kv_events:
        params["kv_events"] = False
    return {key: value for key, value in params.items() if value is not None}


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Third-party chatter (uvicorn access lines, grpc, nats reconnects) stays below warnings
    # unless debugging.
    if level != "debug":
        for name in ("uvicorn.access", "aetcd", "nats"):
            logging.getLogger(name).setLevel(max(logging.WARNING, getattr(logging, level.upper())))


def run_until_stopped(main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run `main(stop)` on uvloop; SIGINT and SIGTERM set `stop` instead of killing the process.

    The handlers are installed with `signal.signal`, not the loop's: uvicorn swaps in its own
    handlers while it serves and re-raises the signals it caught when it returns, which then
    land here and let the command shut its workers down cleanly instead of dying mid-cleanup.
    A second signal exits at once."""
    import uvloop

    async def runner() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        received: list[int] = []

        def on_signal(signum: int, frame: FrameType | None) -> None:
            received.append(signum)
            if len(received) > 1:  # asked again while shutting down: the user insists
                os._exit(128 + signum)
            loop.call_soon_threadsafe(stop.set)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        await main(stop)

    uvloop.run(runner())
    return 0
