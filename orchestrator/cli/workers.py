"""Workers as discovery and the event plane see them, and the pods they run in."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlparse

import aetcd
import msgspec
from kubernetes import client

from orchestrator.cli.kube import EXIT_UNREACHABLE, OperatorError, api_errors, meta
from orchestrator.cli.pools import selector
from orchestrator.runtime.discovery import Discovery
from orchestrator.runtime.protocol import Instance, LoadReport, subject

ETCD_TIMEOUT_S = 5.0
_decode_load = msgspec.msgpack.Decoder(LoadReport).decode


async def list_workers(discovery: Discovery, etcd: str) -> list[Instance]:
    try:
        workers = await asyncio.wait_for(discovery.list("worker"), ETCD_TIMEOUT_S)
    except (TimeoutError, OSError, aetcd.ClientError) as exc:
        raise OperatorError(
            f"cannot read discovery from etcd at {etcd} ({type(exc).__name__}: {exc}). "
            "From outside the cluster, port-forward etcd and pass --etcd http://127.0.0.1:PORT",
            EXIT_UNREACHABLE,
        ) from exc
    return sorted(workers, key=lambda w: w.instance_id)


async def collect_load(nats: str, namespace: str, models: set[str], window_s: float) -> dict[str, LoadReport]:
    """The latest load report per worker heard on the models' load subjects within `window_s`
    (workers publish at least once a second). NATS being away just yields no reports."""
    from orchestrator.runtime.events import make_event_plane  # nats-py loads only when asked

    plane = make_event_plane(nats)
    reports: dict[str, LoadReport] = {}

    async def listen(model: str) -> None:
        sub = await plane.subscribe(subject(namespace, model, "load"))
        async for data in sub:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                report = _decode_load(data)
                reports[report.worker_id] = report

    tasks = [asyncio.create_task(listen(model)) for model in sorted(models)]
    try:
        await asyncio.sleep(window_s)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await plane.close()
    return reports


def address_host(instance: Instance) -> str:
    """The host part of a request-plane address (host:port or tcp://host:port)."""
    address = instance.address if "://" in instance.address else f"tcp://{instance.address}"
    return urlparse(address).hostname or ""


def worker_pods(api: client.ApiClient, namespace: str, release: str | None) -> dict[str, str]:
    """Pod IP -> pod name for the release's worker pods; empty when pods may not be listed,
    since naming pods is a convenience on top of discovery."""
    core = client.CoreV1Api(api)
    try:
        with api_errors(api, f"list worker pods in namespace {namespace}"):
            pods = core.list_namespaced_pod(namespace, label_selector=selector(release)).items
    except OperatorError:
        return {}
    return {p.status.pod_ip: str(meta(p).name) for p in pods if p.status and p.status.pod_ip}
