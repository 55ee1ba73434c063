"""`weir`: entry point. Each subcommand lives in its own module, imported only when run,
so `weir scale` does not pay for torch and `weir serve` does not pay for kubernetes."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

from orchestrator.cli.options import add_environment_defaults

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("orchestrator.cli.serve", "frontend and local workers in one process, no etcd or NATS"),
    "frontend": ("orchestrator.cli.frontend", "the OpenAI-compatible frontend (cluster mode)"),
    "worker": ("orchestrator.cli.worker", "one engine worker (cluster mode)"),
    "router": ("orchestrator.cli.router", "the KV-aware router as a standalone service (cluster mode)"),
    "replay": ("orchestrator.cli.replay", "replay a Mooncake-format request trace"),
    "bench": ("orchestrator.cli.bench", "benchmark a serving endpoint: latency percentiles, goodput"),
    "scale": ("orchestrator.cli.scale", "set a pool's replica count on Kubernetes"),
    "status": ("orchestrator.cli.status", "pools on Kubernetes and workers in discovery"),
    "drain": ("orchestrator.cli.drain", "stop routing to a worker and wait for its requests"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weir", description="Weir inference control plane")
    parser.add_argument("--version", action="version", version=f"weir {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        command = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).register(command)
        add_environment_defaults(command)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("weir")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed; pip install -e .)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(only=command).parse_args(argv)
    if args.command is None:
        build_parser(only="").print_help()
        return 2
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
