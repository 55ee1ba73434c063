"""`weir status`: the release's pools as Kubernetes sees them (role, desired and ready
replicas), and the workers registered in discovery with their role and load, counted by role
(a disaggregated model's prefill and decode workers side by side).

Load comes from the workers' own load reports on NATS, heard for `--load-window` seconds
(they publish at least once a second); without NATS the load columns stay empty. Each part
is shown even when the other fails; the exit code is then the first failure's.

Without Kubernetes (no kubeconfig and not in a pod, or `--no-kubernetes`), discovery named by
`--etcd` is all there is to show, and that is no failure: a cluster of `weir worker`s on
plain hosts has no pools. A kubeconfig that does not work still is one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field

import msgspec

from orchestrator.cli.kube import (
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    OperatorError,
    add_cluster_args,
    api_client,
    kubernetes_configured,
    namespace,
)
from orchestrator.cli.planes import Planes, add_plane_args, from_flags, from_release
from orchestrator.cli.pools import Pool, list_pools
from orchestrator.cli.workers import address_host, collect_load, list_workers, worker_pods
from orchestrator.runtime.discovery import make_discovery
from orchestrator.runtime.protocol import Instance, LoadReport


@dataclass
class Report:
    namespace: str
    release: str | None
    pools: list[Pool] = field(default_factory=list)
    planes: Planes | None = None
    workers: list[dict[str, object]] = field(default_factory=list)
    errors: list[OperatorError] = field(default_factory=list)
    kubernetes_skipped: str | None = None  # why Kubernetes was not asked, when it was not


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table")
    parser.add_argument(
        "--load-window",
        type=float,
        default=1.5,
        metavar="S",
        help="seconds to listen for load reports on NATS (0: do not listen)",
    )
    parser.add_argument("--no-discovery", action="store_true", help="show the Kubernetes pools only")
    parser.add_argument(
        "--no-kubernetes",
        action="store_true",
        help="show discovery (--etcd) only, without asking Kubernetes for pools (the default "
        "when there is no kubeconfig and this is not a pod)",
    )
    add_cluster_args(parser)
    add_plane_args(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.no_kubernetes and args.no_discovery:
        print("weir status: --no-kubernetes and --no-discovery leave nothing to show", file=sys.stderr)
        return EXIT_USAGE
    report = gather(args)
    if args.output == "json":
        print(json.dumps(to_json(report), indent=2))
    else:
        print(to_table(report))
    for error in report.errors:
        print(f"weir status: {error}", file=sys.stderr)
    return report.errors[0].exit_code if report.errors else 0


def gather(args: argparse.Namespace) -> Report:
    report = Report(namespace=namespace(args), release=args.release)
    pods: dict[str, str] = {}
    # --no-discovery asks for pools only: then Kubernetes not being there is the failure it was.
    if args.no_kubernetes or not (args.no_discovery or kubernetes_configured(args)):
        report.kubernetes_skipped = (
            "skipped (--no-kubernetes)"
            if args.no_kubernetes
            else "not configured (no kubeconfig, not in a pod)"
        )
        report.planes = from_flags(args)
        if report.planes is None:
            message = f"Kubernetes {report.kubernetes_skipped}: pass --etcd URL to read discovery"
            report.errors.append(OperatorError(message, EXIT_UNREACHABLE))
    else:
        _gather_kubernetes(args, report, pods)
    if report.planes is not None:
        try:
            workers, loads = asyncio.run(_discovery(report.planes, args.load_window))
        except OperatorError as exc:
            report.errors.append(exc)
        else:
            report.workers = [_worker_row(w, loads.get(w.instance_id), pods) for w in workers]
    return report


def _gather_kubernetes(args: argparse.Namespace, report: Report, pods: dict[str, str]) -> None:
    """Pools, then (unless --no-discovery) the planes and the worker pods' names."""
    try:
        with api_client(args) as api:
            report.pools = list_pools(api, report.namespace, args.release)
            if not args.no_discovery:
                report.planes = from_flags(args) or from_release(api, report.namespace, args)
                pods.update(worker_pods(api, report.namespace, args.release))
    except OperatorError as exc:
        report.errors.append(exc)
        # Kubernetes is away, but discovery named by flags can still be read.
        report.planes = None if args.no_discovery else from_flags(args)


async def _discovery(planes: Planes, window_s: float) -> tuple[list[Instance], dict[str, LoadReport]]:
    discovery = make_discovery(planes.etcd, planes.namespace)
    try:
        workers = await list_workers(discovery, planes.etcd)
    finally:
        await discovery.close()
    models = {w.card.name for w in workers if w.card is not None}
    if planes.nats is None or window_s <= 0 or not models:
        return workers, {}
    return workers, await collect_load(planes.nats, planes.namespace, models, window_s)


def _worker_row(worker: Instance, load: LoadReport | None, pods: dict[str, str]) -> dict[str, object]:
    card = worker.card
    return {
        "instance_id": worker.instance_id,
        "pod": pods.get(address_host(worker)),
        "model": card.name if card else None,
        "role": card.role if card else None,
        "backend": card.backend if card else None,
        "kv_tiers": card.kv_tiers if card else {},
        "address": worker.address,
        "state": "draining" if worker.draining or (load is not None and load.draining) else "serving",
        "load": msgspec.to_builtins(load) if load is not None else None,
    }


def to_json(report: Report) -> dict[str, object]:
    planes = report.planes
    return {
        "namespace": report.namespace,
        "release": report.release,
        "pools": [asdict(p) for p in report.pools],
        "discovery": asdict(planes) if planes else None,
        "workers": report.workers,
        "roles": role_counts(report.workers),
        "errors": [{"message": str(e), "exit_code": e.exit_code} for e in report.errors],
        "kubernetes_skipped": report.kubernetes_skipped,
    }


def role_counts(workers: list[dict[str, object]]) -> dict[str, int]:
    """Workers in discovery per role (aggregated, prefill, decode), by role name."""
    return dict(sorted(Counter(str(w["role"]) for w in workers).items()))


def _tiers(tiers: object) -> str:
    """host:65536,disk:1048576,remote: blocks per tier (a shared remote tier has no count)."""
    if not isinstance(tiers, dict) or not tiers:
        return "-"
    return ",".join(f"{tier}:{blocks}" if blocks else tier for tier, blocks in tiers.items())


def to_table(report: Report) -> str:
    if report.kubernetes_skipped is not None:
        lines = [f"Pools: not shown, Kubernetes {report.kubernetes_skipped}"]
    else:
        lines = [
            f"Pools in namespace {report.namespace}"
            + (f", release {report.release}" if report.release else "")
        ]
        pool_rows = [
            [p.release, p.name, p.role, p.backend, str(p.desired), str(p.ready), p.deployment]
            for p in report.pools
        ]
        header = ["RELEASE", "POOL", "ROLE", "BACKEND", "DESIRED", "READY", "DEPLOYMENT"]
        lines += _columns(header, pool_rows)
    if report.planes is None:
        return "\n".join(lines)
    planes = report.planes
    lines += [
        "",
        f"Workers in discovery (weir namespace {planes.namespace}, etcd {planes.etcd}, from {planes.source})",
    ]
    worker_rows = []
    for w in report.workers:
        load = w["load"] if isinstance(w["load"], dict) else {}
        kv = f"{load.get('active_blocks', 0)}/{load.get('total_blocks', 0)}" if load else "-"
        worker_rows.append(
            [
                str(w["instance_id"]),
                str(w["pod"] or "-"),
                str(w["model"]),
                str(w["role"]),
                str(w["backend"]),
                str(w["address"]),
                str(w["state"]),
                str(load.get("active_requests", 0)) if load else "-",
                str(load.get("waiting_requests", 0)) if load else "-",
                kv,
                _tiers(w["kv_tiers"]),
            ]
        )
    header = [
        "INSTANCE",
        "POD",
        "MODEL",
        "ROLE",
        "BACKEND",
        "ADDRESS",
        "STATE",
        "ACTIVE",
        "WAITING",
        "KV BLOCKS",
        "KV TIERS",
    ]
    lines += _columns(header, worker_rows)
    if report.workers:
        counts = role_counts(report.workers)
        lines.append("By role: " + ", ".join(f"{role} {n}" for role, n in counts.items()))
    return "\n".join(lines)


def _columns(header: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return ["  (none)"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
