"""Flags shared by the serving commands (`serve`, `frontend`, `worker`, `router`), and the
environment variables of every command's flags.

Every flag also reads an environment variable, named in its help text, so a container image
can be configured without a command line: the flag wins, then the variable, then the default.
`add_environment_defaults` gives each flag `WEIR_<FLAG>` (`--kv-overlap-weight`:
WEIR_KV_OVERLAP_WEIGHT); a flag whose help already names another variable (`env WEIR_...`,
set with `env_default`) keeps that one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from types import FrameType
from typing import Any

from orchestrator.runtime.discovery import DEFAULT_TTL
from orchestrator.runtime.request_plane import PlaneSecurity
from orchestrator.runtime.request_plane.security import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_PEER,
    DEFAULT_MAX_FRAME_BYTES,
    client_tls_context,
    server_tls_context,
)
from router.block_index import LOWER_TIERS
from router.cost import CostParams
from router.disagg import DEFAULT_MIN_UNCACHED_TOKENS, DisaggPolicy
from router.disagg import MODES as DISAGG_MODES

LOG_LEVELS = ("debug", "info", "warning", "error")
ENV_PREFIX = "WEIR_"
# How a help text names its flag's variable; the help is where users look for it.
_NAMED_VARIABLE = re.compile(r"\benv (WEIR_[A-Z0-9_]+)")
_TRAILING_DEFAULT = re.compile(r"\((default\b[^()]*)\)$")
_BOOLEANS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def env_default(name: str, default: Any = None, convert: Callable[[str], Any] = str) -> Any:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return convert(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        raise SystemExit(f"weir: environment variable {name}={value!r} is invalid: {exc}") from exc


def add_environment_defaults(parser: argparse.ArgumentParser) -> None:
    """Let `WEIR_<FLAG>` set the default of each of `parser`'s flags whose help names no
    variable yet, and name it there. Call once the parser has all its flags."""
    for action in parser._actions:
        if not _settable_from_environment(action) or _NAMED_VARIABLE.search(action.help or ""):
            continue
        flag = next(option for option in action.option_strings if option.startswith("--"))
        name = ENV_PREFIX + flag[2:].upper().replace("-", "_")
        value = env_default(name, None, _env_converter(action))
        if value is not None:
            action.default = value
            action.required = False
        action.help = _name_variable(action.help, name)


def _settable_from_environment(action: argparse.Action) -> bool:
    """Not positionals, --help, --version, hidden flags, nor kinds of action (append, count,
    several values) that one string cannot stand for."""
    return (
        bool(action.option_strings)
        and action.help != argparse.SUPPRESS
        and action.nargs in (None, 0)
        and isinstance(action, argparse._StoreAction | argparse._StoreConstAction)
    )


def _env_converter(action: argparse.Action) -> Callable[[str], Any]:
    if isinstance(action, argparse._StoreConstAction):  # a switch: set means given
        const, unset = action.const, action.default

        def switch(text: str) -> Any:
            if text.lower() not in _BOOLEANS:
                raise ValueError(f"expected one of {', '.join(_BOOLEANS)}")
            return const if _BOOLEANS[text.lower()] else unset

        return switch
    convert: Callable[[str], Any] = action.type if callable(action.type) else str
    choices = action.choices

    def value(text: str) -> Any:
        converted = convert(text)
        if choices is not None and converted not in choices:
            raise ValueError(f"choose from {', '.join(map(str, choices))}")
        return converted

    return value


def _name_variable(help_text: str | None, name: str) -> str:
    """'... (default 8)' becomes '... (env WEIR_X; default 8)', the hand-written flags' style."""
    if help_text is None:
        return f"(env {name})"
    with_default = _TRAILING_DEFAULT.sub(lambda found: f"(env {name}; {found.group(1)})", help_text)
    return with_default if with_default != help_text else f"{help_text} (env {name})"


def add_old_spelling(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Keep `old`, the former spelling of flag `new`, working for one release: hidden from
    --help (and from the environment), and saying on stderr what to write instead."""
    parser.add_argument(old, action=_OldSpelling, target=parser._option_string_actions[new])


class _OldSpelling(argparse.Action):
    """Parses its values as `target` does, then hands them to it."""

    def __init__(self, option_strings: list[str], dest: str, target: argparse.Action) -> None:
        super().__init__(
            option_strings,
            target.dest,
            nargs=target.nargs,
            type=target.type if callable(target.type) else None,  # no registry names here
            choices=target.choices,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
        self.target = target

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        new = self.target.option_strings[-1]
        print(
            f"{parser.prog}: {option_string} is now {new}; the old spelling goes in the next release",
            file=sys.stderr,
        )
        self.target(parser, namespace, values, new)


def add_log_level(parser: argparse.ArgumentParser, default: str = "warning") -> None:
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=default,
        help=f"log verbosity (default {default})",
    )


def add_cluster_planes(parser: argparse.ArgumentParser) -> None:
    """--namespace, --etcd, --nats: where cluster-mode processes find each other."""
    group = parser.add_argument_group("cluster planes")
    group.add_argument(
        "--weir-namespace",
        dest="namespace",
        default=env_default("WEIR_NAMESPACE", "default"),
        help="weir namespace: prefix of discovery keys and event subjects "
        "(env WEIR_NAMESPACE; default 'default')",
    )
    add_old_spelling(parser, "--namespace", "--weir-namespace")
    group.add_argument(
        "--etcd",
        default="http://127.0.0.1:2379",
        help="etcd URL for discovery; credentials as http://user:password@host:2379, TLS as "
        "https://host:2379 (CAs: gRPC's or $SSL_CERT_FILE; a client certificate from "
        "$WEIR_ETCD_CERT_FILE and $WEIR_ETCD_KEY_FILE) (default http://127.0.0.1:2379)",
    )
    group.add_argument(
        "--nats",
        default="nats://127.0.0.1:4222",
        help="NATS URL for KV events and load reports; credentials as nats://user:password@host:4222 "
        "or nats://token@host:4222, TLS as tls://host:4222 (CAs: the system's or $SSL_CERT_FILE) "
        "(default nats://127.0.0.1:4222)",
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
        help="address frontends dial, when --host is a wildcard (default: --host, or this host's address)",
    )
    plane.add_argument(
        "--metrics-port",
        type=int,
        help="serve /live, /health and /metrics on this port (default: off)",
    )
    plane.add_argument(
        "--instance-id",
        help=f"this {what}'s id in discovery (default: hostname + random suffix)",
    )
    plane.add_argument(
        "--lease-ttl",
        type=float,
        default=DEFAULT_TTL,
        metavar="SECONDS",
        help=f"discovery lease: a dead {what} disappears after this long (default {DEFAULT_TTL:g})",
    )
    plane.add_argument(
        "--max-frame-bytes",
        type=int,
        default=DEFAULT_MAX_FRAME_BYTES,
        help="a caller's frame announcing more than this closes its connection "
        f"(default {DEFAULT_MAX_FRAME_BYTES})",
    )
    plane.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"request-plane connections beyond this are closed at once (default {DEFAULT_MAX_CONNECTIONS})",
    )
    plane.add_argument(
        "--max-connections-per-peer",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS_PER_PEER,
        help="connections from one IP beyond this are closed at once "
        f"(default {DEFAULT_MAX_CONNECTIONS_PER_PEER})",
    )
    add_plane_security(parser, serving=True)


def add_plane_security(parser: argparse.ArgumentParser, serving: bool) -> None:
    """The cluster secret and TLS of the request plane: every process that listens on it or
    dials it (`serving`: it listens, so it takes a certificate too)."""
    group = parser.add_argument_group("request-plane security")
    group.add_argument(
        "--cluster-secret",
        metavar="SECRET",
        help="shared secret every weir process of the cluster proves it holds when it connects "
        "(16+ bytes; set WEIR_CLUSTER_SECRET rather than the flag, which others see in the "
        "process list; default: none, the request plane is open)",
    )
    group.add_argument(
        "--cluster-secret-file",
        metavar="PATH",
        help="read the cluster secret from this file (a mounted Kubernetes Secret)",
    )
    if serving:
        group.add_argument("--tls-cert", metavar="PEM", help="serve the request plane over TLS: certificate")
        group.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    group.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="dial the request plane over TLS, trusting servers this CA signed",
    )


def plane_security(args: argparse.Namespace, serving: bool) -> PlaneSecurity:
    """The `PlaneSecurity` of `add_plane_security`'s flags, and of the limits on a service
    (`serving`; a frontend's --max-connections is its HTTP limit, not this)."""
    secret: str | None = args.cluster_secret
    if args.cluster_secret_file:
        try:
            with open(args.cluster_secret_file, encoding="utf-8") as file:
                secret = file.read().strip()
        except OSError as exc:
            raise SystemExit(f"weir: cannot read --cluster-secret-file: {exc}") from exc
    cert, key = (args.tls_cert, args.tls_key) if serving else (None, None)
    if bool(cert) != bool(key):
        raise SystemExit("weir: --tls-cert and --tls-key go together")
    limits = (
        {
            "max_frame_bytes": args.max_frame_bytes,
            "max_connections": args.max_connections,
            "max_connections_per_peer": args.max_connections_per_peer,
        }
        if serving
        else {}
    )
    try:
        return PlaneSecurity(
            secret=secret.encode() if secret else None,
            server_tls=server_tls_context(cert, key) if cert and key else None,
            client_tls=client_tls_context(args.tls_ca) if args.tls_ca else None,
            **limits,
        )
    except (ValueError, OSError) as exc:  # a short secret, unreadable or bad PEM files
        raise SystemExit(f"weir: {exc}") from exc


def add_router_arguments(
    parser: argparse.ArgumentParser, modes: Sequence[str], default_mode: str, default_seed: int | None = None
) -> argparse._ArgumentGroup:
    """--router-mode and the router's parameters (`frontend`, `serve`, `router`, `replay`);
    returns the group for command-specific additions."""
    routing = parser.add_argument_group("routing")
    routing.add_argument(
        "--router-mode",
        choices=modes,
        default=default_mode,
        help=f"how a worker is chosen (default {default_mode})",
    )
    routing.add_argument(
        "--kv-overlap-weight",
        type=float,
        help="kv mode: weight of prompt blocks a worker must compute against its active blocks (default 1.0)",
    )
    routing.add_argument(
        "--kv-tier-credits",
        type=tier_credits,
        metavar="TIER=CREDIT,...",
        help="kv mode: the fraction of a device hit that a hit in a lower KV tier saves, per tier "
        "(host, disk, remote); tiers left out keep theirs (default host=0.5,disk=0.25,remote=0.1)",
    )
    routing.add_argument(
        "--kv-balance-abs-requests",
        type=int,
        metavar="N",
        help="kv and ttft modes, the herding guard: leave out a worker with N more requests than the "
        "least loaded one and --kv-balance-rel times as many; 0 turns the guard off (default 8)",
    )
    routing.add_argument(
        "--kv-balance-rel",
        type=float,
        metavar="R",
        help="kv and ttft modes, the herding guard: the ratio to the least loaded worker's requests "
        "that a worker must also pass to be left out (default 1.5)",
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
    routing.add_argument(
        "--router-seed",
        type=int,
        default=default_seed,
        help="seed for random choices, for reproducible runs"
        + ("" if default_seed is None else f" (default {default_seed})"),
    )
    return routing


def add_disaggregation_arguments(group: argparse._ArgumentGroup, what: str) -> None:
    """--disaggregation and --disagg-min-uncached-tokens (`frontend`, `serve`, `replay`); `what`
    says where the flags apply, for their help."""
    group.add_argument(
        "--disaggregation",
        choices=DISAGG_MODES,
        default="adaptive",
        help=f"{what}: send a request's prefill to a prefill worker never, always, or when it pays "
        "(adaptive: the prefill pool would start it no later than the whole-request workers) "
        "(default adaptive)",
    )
    group.add_argument(
        "--disagg-min-uncached-tokens",
        type=int,
        default=DEFAULT_MIN_UNCACHED_TOKENS,
        metavar="N",
        help="adaptive: keep a request whole when fewer of its prompt tokens than this are uncached "
        f"(NVIDIA Dynamo uses 2048) (default {DEFAULT_MIN_UNCACHED_TOKENS})",
    )


def disagg_policy(args: argparse.Namespace) -> DisaggPolicy:
    """The policy the disaggregation flags describe; SystemExit with the reason if they are wrong."""
    try:
        return DisaggPolicy(args.disaggregation, args.disagg_min_uncached_tokens)
    except ValueError as exc:
        raise SystemExit(f"weir: {exc}") from exc


def tier_credits(value: str) -> dict[str, float]:
    """`host=0.5,remote=0.1` -> {"host_credit": 0.5, "remote_credit": 0.1} (CostParams fields)."""
    credits: dict[str, float] = {}
    for item in value.split(","):
        tier, sep, credit = item.partition("=")
        tier = tier.strip()
        if not sep or tier not in LOWER_TIERS:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected TIER=CREDIT with TIER one of {', '.join(LOWER_TIERS)}"
            )
        try:
            number = float(credit)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: the credit must be a number") from None
        if not 0.0 <= number <= 1.0:
            raise argparse.ArgumentTypeError(f"{item!r}: the credit must be within [0, 1]")
        credits[f"{tier}_credit"] = number
    return credits


def router_params(args: argparse.Namespace) -> dict[str, Any]:
    """Only what the user set, so the router's own defaults stay the single source."""
    params: dict[str, Any] = {
        "overlap_weight": args.kv_overlap_weight,
        "temperature": args.router_temperature,
        "balance_abs_requests": args.kv_balance_abs_requests,
        "balance_rel": args.kv_balance_rel,
        "seed": args.router_seed,
        **(args.kv_tier_credits or {}),
    }
    if args.no_kv_events:
        params["kv_events"] = False
    params = {key: value for key, value in params.items() if value is not None}
    try:  # refused here, with the reason, rather than as a traceback where the router is built
        CostParams(**{key: value for key, value in params.items() if key not in ("seed", "kv_events")})
    except ValueError as exc:
        raise SystemExit(f"weir: {exc}") from exc
    return params


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
