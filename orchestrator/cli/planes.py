"""Where a release's discovery (etcd) and event plane (NATS) are, for `weir status` and `weir drain`.

First the flags, then the environment the chart's pods get (WEIR_ETCD, WEIR_NATS,
WEIR_NAMESPACE), then the release's own ConfigMap, read through the Kubernetes API. The
ConfigMap holds in-cluster service names: from outside the cluster, port-forward and pass
--etcd/--nats instead.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kubernetes import client

from orchestrator.cli.kube import EXIT_NOT_FOUND, EXIT_USAGE, OperatorError, api_errors, meta
from orchestrator.cli.options import env_default
from orchestrator.cli.pools import COMPONENT_LABEL, NAME_LABEL, RELEASE_LABEL


@dataclass(frozen=True, slots=True)
class Planes:
    etcd: str
    nats: str | None
    namespace: str  # the weir namespace: prefix of discovery keys and event subjects
    source: str  # where the addresses came from, for the user


def add_plane_args(parser: argparse.ArgumentParser, load: bool = True) -> None:
    """--etcd and --weir-namespace; with `load`, also --nats (where load reports are heard)."""
    group = parser.add_argument_group("discovery")
    group.add_argument(
        "--etcd",
        help="etcd URL, e.g. http://127.0.0.1:2379 (default: the release's ConfigMap)",
    )
    if load:
        group.add_argument(
            "--nats",
            help="NATS URL for load reports (default: the release's ConfigMap)",
        )
    group.add_argument(
        "--weir-namespace",
        default=env_default("WEIR_NAMESPACE"),
        help="weir namespace of discovery keys (env WEIR_NAMESPACE; default: the ConfigMap's)",
    )


def from_flags(args: argparse.Namespace) -> Planes | None:
    """The planes when the flags or environment name etcd; None when the ConfigMap must tell."""
    if not args.etcd:
        return None
    weir_ns = args.weir_namespace or args.release or "default"
    return Planes(etcd=args.etcd, nats=getattr(args, "nats", None), namespace=weir_ns, source="flags")


def from_release(api: client.ApiClient, k8s_namespace: str, args: argparse.Namespace) -> Planes:
    core = client.CoreV1Api(api)
    label = f"{NAME_LABEL}=weir,{COMPONENT_LABEL}=config"
    if args.release:
        label += f",{RELEASE_LABEL}={args.release}"
    with api_errors(api, f"read the weir ConfigMap in namespace {k8s_namespace}"):
        found = core.list_namespaced_config_map(k8s_namespace, label_selector=label).items
    if not found:
        raise OperatorError(
            f"no weir release in namespace {k8s_namespace}"
            + (f" named {args.release}" if args.release else "")
            + "; pass --etcd to read discovery directly",
            EXIT_NOT_FOUND,
        )
    if len(found) > 1:
        names = ", ".join((meta(cm).labels or {}).get(RELEASE_LABEL, "?") for cm in found)
        raise OperatorError(
            f"several weir releases in namespace {k8s_namespace} ({names}): choose one with --release",
            EXIT_USAGE,
        )
    data = found[0].data or {}
    if "WEIR_ETCD" not in data:
        raise OperatorError(f"ConfigMap {meta(found[0]).name} has no WEIR_ETCD", EXIT_NOT_FOUND)
    return Planes(
        etcd=args.etcd or data["WEIR_ETCD"],
        nats=getattr(args, "nats", None) or data.get("WEIR_NATS"),
        namespace=args.weir_namespace or data.get("WEIR_NAMESPACE") or "default",
        source=f"ConfigMap {k8s_namespace}/{meta(found[0]).name}",
    )
