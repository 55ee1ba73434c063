"""`weir scale POOL --replicas N`: set a worker pool's size through its Deployment's scale
subresource, the same door HPA and the planner use, so the three compose instead of fighting
over the Deployment spec."""

from __future__ import annotations

import argparse
import sys

from kubernetes import client

from orchestrator.cli.kube import OperatorError, add_cluster_args, api_client, api_errors, namespace
from orchestrator.cli.pools import find_pool


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pool", help="pool name, as in the chart's `pools:` list (see `weir status`)")
    parser.add_argument("--replicas", type=_replicas, required=True, help="new number of workers (0 or more)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="ask the API server to check the change (permissions included) without applying it",
    )
    add_cluster_args(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        print(scale(args))
    except OperatorError as exc:
        print(f"weir scale: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def scale(args: argparse.Namespace) -> str:
    ns = namespace(args)
    with api_client(args) as api:
        pool = find_pool(api, ns, args.release, args.pool)
        apps = client.AppsV1Api(api)
        with api_errors(api, f"scale Deployment {ns}/{pool.deployment}"):
            result = apps.patch_namespaced_deployment_scale(
                pool.deployment,
                ns,
                {"spec": {"replicas": args.replicas}},
                dry_run="All" if args.dry_run else None,
                _content_type="application/merge-patch+json",
            )
    new = result.spec.replicas if result.spec else args.replicas
    prefix = "dry run: would scale" if args.dry_run else "scaled"
    return (
        f"{prefix} pool {pool.name} (deployment {ns}/{pool.deployment}) from {pool.desired} to {new} replicas"
    )


def _replicas(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value
