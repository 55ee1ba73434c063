"""`weir drain WORKER`: stop routing new requests to a worker, wait until its in-flight requests
have finished, then leave it safe to remove.

The protocol lives in discovery (see orchestrator/runtime/discovery/keys.py): we put
`drain/<instance_id>`; the worker advertises `draining`, refuses new requests (routers skip it),
finishes what it has, and puts `drained/<instance_id>`. WORKER is an instance id (as `weir
status` lists them) or a worker pod's name, which drains every instance in that pod. Once
drained, the pod gets the lowest deletion cost, so the next scale-down of its pool removes it.
The drain key stays after a timeout: the worker keeps draining.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import aetcd
from kubernetes import client

from orchestrator.cli.kube import (
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    EXIT_UNREACHABLE,
    OperatorError,
    add_cluster_args,
    api_client,
    api_errors,
    namespace,
)
from orchestrator.cli.options import add_old_spelling
from orchestrator.cli.planes import Planes, add_plane_args, from_flags, from_release
from orchestrator.cli.workers import address_host, list_workers, worker_pods
from orchestrator.runtime.discovery import Discovery, drain_key, drained_key, instance_key, make_discovery
from orchestrator.runtime.protocol import Instance

POLL_S = 0.25
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass(frozen=True, slots=True)
class Target:
    instance: Instance
    pod: str | None


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("worker", help="instance id (see `weir status`) or worker pod name")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds to wait for in-flight requests (default 600); exit 1 when exceeded",
    )
    add_cluster_args(parser)
    add_plane_args(parser, load=False)
    add_old_spelling(parser, "--timeout", "--drain-timeout")  # `weir worker` calls it --drain-timeout
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        drain(args, say=lambda line: print(line, flush=True))
    except OperatorError as exc:
        print(f"weir drain: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def drain(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    planes = from_flags(args)
    if planes is not None and not _kube_flags_given(args):
        # --etcd (or WEIR_ETCD) alone: work on bare etcd, by instance id, without the API.
        asyncio.run(_drain(planes, args.worker, {}, args.drain_timeout, say))
        return
    k8s_ns = namespace(args)
    with api_client(args) as api:
        planes = planes or from_release(api, k8s_ns, args)
        pods = worker_pods(api, k8s_ns, args.release)
        targets = asyncio.run(_drain(planes, args.worker, pods, args.drain_timeout, say))
        for pod in sorted({t.pod for t in targets if t.pod}):
            say(_mark_for_removal(api, k8s_ns, pod))


def _kube_flags_given(args: argparse.Namespace) -> bool:
    return bool(args.kubeconfig or args.context or args.namespace or args.release)


async def _drain(
    planes: Planes, worker: str, pods: dict[str, str], timeout: float, say: Callable[[str], None]
) -> list[Target]:
    discovery = make_discovery(planes.etcd, planes.namespace)
    try:
        targets = _resolve(await list_workers(discovery, planes.etcd), worker, pods)
        for target in targets:
            request = json.dumps({"requested_by": "weir drain", "at": time.time()}).encode()
            await discovery.put(drain_key(target.instance.instance_id), request)
        await _wait(discovery, targets, timeout, say)
        return targets
    except aetcd.ClientError as exc:
        raise OperatorError(f"lost etcd at {planes.etcd} while draining: {exc!r}", EXIT_UNREACHABLE) from exc
    finally:
        await discovery.close()


def _resolve(workers: list[Instance], worker: str, pods: dict[str, str]) -> list[Target]:
    pod_of = {w.instance_id: pods.get(address_host(w)) for w in workers}
    by_id = [w for w in workers if w.instance_id == worker]
    chosen = by_id or [w for w in workers if pod_of[w.instance_id] == worker]
    if not chosen:
        known = ", ".join(w.instance_id for w in workers) or "none"
        raise OperatorError(
            f"no worker {worker!r} in discovery (instance ids or pod names; registered: {known})",
            EXIT_NOT_FOUND,
        )
    return [Target(w, pod_of[w.instance_id]) for w in chosen]


async def _wait(
    discovery: Discovery, targets: list[Target], timeout: float, say: Callable[[str], None]
) -> None:
    """Polls rather than watches: a watch that starts after the worker drained and exited
    would wait forever, while a poll sees the instance gone."""
    waiting = {t.instance.instance_id for t in targets}
    say(f"draining {', '.join(sorted(waiting))}: new requests go elsewhere")
    started = time.monotonic()
    while waiting:
        for instance_id in sorted(waiting):
            if await discovery.get(drained_key(instance_id)) is not None:
                say(f"{instance_id} drained after {time.monotonic() - started:.1f}s: no requests in flight")
                waiting.discard(instance_id)
            elif await discovery.get(instance_key("worker", instance_id)) is None:
                say(f"{instance_id} left discovery before reporting drained (it exited)")
                waiting.discard(instance_id)
        if waiting and time.monotonic() - started > timeout:
            raise OperatorError(
                f"{', '.join(sorted(waiting))} still had requests in flight after {timeout:.0f}s; "
                "it keeps draining (refusing new requests). Wait longer or stop it anyway.",
                EXIT_FAILED,
            )
        if waiting:
            await asyncio.sleep(POLL_S)


def _mark_for_removal(api: client.ApiClient, k8s_ns: str, pod: str) -> str:
    core = client.CoreV1Api(api)
    patch = {"metadata": {"annotations": {DELETION_COST: "-1000000"}}}
    try:
        with api_errors(api, f"annotate pod {k8s_ns}/{pod}"):
            core.patch_namespaced_pod(pod, k8s_ns, patch, _content_type="application/merge-patch+json")
    except OperatorError as exc:
        return f"pod {pod} is drained; could not mark it for the next scale-down: {exc}"
    return (
        f"pod {pod} is drained and marked to go first: scale its pool down by one with `weir scale`, "
        f"or delete it with `kubectl delete pod -n {k8s_ns} {pod}`"
    )
