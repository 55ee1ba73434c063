"""`weir scale POOL --replicas N`: set a worker pool's size through its Deployment's scale
subresource, the same door HPA uses (and a planner will, once there is one), so they compose
instead of fighting over the Deployment spec. Disaggregated serving has a pool per role
(prefill, decode), each sized on its own; the output names the pool's role."""

from __future__ import annotations

import argparse
import sys

from kubernetes import client

from orchestrator.cli.kube import OperatorError, add_cluster_args, api_client, api_errors, meta, namespace
from orchestrator.cli.pools import find_pool


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "pool",
        help="pool name, as in the chart's `pools:` list; a prefill and a decode pool are two pools, "
        "each scaled by its own name (`weir status` shows each pool's role)",
    )
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
        autoscaler = _autoscaler_note(api, ns, pool.deployment)
    new = result.spec.replicas if result.spec else args.replicas
    prefix = "dry run: would scale" if args.dry_run else "scaled"
    done = (
        f"{prefix} pool {pool.name} (role {pool.role}, deployment {ns}/{pool.deployment}) "
        f"from {pool.desired} to {new} replicas"
    )
    return done if autoscaler is None else f"{done}\n{autoscaler}"


def _autoscaler_note(api: client.ApiClient, ns: str, deployment: str) -> str | None:
    """A HorizontalPodAutoscaler on the same Deployment moves the size back into its own range;
    say so rather than let the change revert silently. Best effort: no permission, no note."""
    autoscaling = client.AutoscalingV1Api(api)
    try:
        with api_errors(api, f"list HorizontalPodAutoscalers in {ns}"):
            found = autoscaling.list_namespaced_horizontal_pod_autoscaler(ns).items
    except OperatorError:
        return None
    for hpa in found:
        spec = hpa.spec
        if (
            spec is not None
            and spec.scale_target_ref.kind == "Deployment"
            and spec.scale_target_ref.name == deployment
        ):
            return (
                f"note: HorizontalPodAutoscaler {meta(hpa).name} also sizes this pool "
                f"(min {spec.min_replicas or 1}, max {spec.max_replicas}); it keeps the size in that range"
            )
    return None


def _replicas(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value
