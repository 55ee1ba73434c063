"""The standalone router: `weir router`, three `weir worker --backend mocker` processes and
`weir frontend --router-mode remote` over real etcd and NATS.

Requests sharing a long prefix land on the worker that cached it, decided by the router
(its /metrics count them, the frontend decides nothing itself). SIGKILL the router: the
frontend keeps serving, placing requests least-loaded by itself (docs/router.md). Start the
router again: it rebuilds its index from the workers' snapshots, and the frontend goes back
to it, so the prefix finds a worker holding it again."""

from __future__ import annotations

import itertools
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from backends.registry import DEFAULT_MODEL
from tests.cli.procs import wait_healthy, weir_process
from tests.cluster import LEASE_TTL, metric, planes, start_frontend, start_workers
from tests.router.cluster import PREFIX, WORKERS, KvCluster, new_requests
from tests.servers import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

DECISIONS = "weir_router_decisions_total"
OVERLAP = "weir_router_chosen_overlap_blocks_total"
KV = f'model="{DEFAULT_MODEL}",mode="kv"'
LOCAL = f'model="{DEFAULT_MODEL}",mode="least-loaded"'


@dataclass
class Setup:
    cluster: KvCluster
    start_router: Callable[[], subprocess.Popen[bytes]]
    router_metrics: str

    def router_metric(self, name: str, labels: str) -> float:
        return metric(httpx.get(f"{self.router_metrics}/metrics", timeout=5).text, name, labels)

    def router_kv_events_applied(self) -> float:
        return self.router_metric("weir_router_kv_events_applied_total", f'model="{DEFAULT_MODEL}"')


@pytest.fixture
def setup(etcd_url: str, nats_url: str, tmp_path: Path) -> Iterator[Setup]:
    plane_args = planes(etcd_url, nats_url, "rs")
    port, metrics_port = free_port(), free_port()
    router_url = f"http://127.0.0.1:{metrics_port}"
    with ExitStack() as stack:
        starts = 0

        def start_router() -> subprocess.Popen[bytes]:
            """A router on the same ports each time, once it knows every worker."""
            nonlocal starts
            starts += 1
            log = tmp_path / f"router-{starts}.log"
            proc = stack.enter_context(
                weir_process(
                    "router",
                    *plane_args,
                    *("--port", str(port), "--metrics-port", str(metrics_port)),
                    *("--instance-id", "router", "--lease-ttl", str(LEASE_TTL), "--log-level", "info"),
                    log=log,
                )
            )
            wait_healthy(router_url, proc, log)
            labels = f'model="{DEFAULT_MODEL}"'
            wait_until(
                lambda: result.router_metric("weir_router_workers", labels) >= len(WORKERS),
                "the router to see all workers",
                60,
                proc=proc,
                log=log,
            )
            return proc

        _, worker_metrics = start_workers(stack, plane_args, tmp_path, WORKERS)
        address = ("--router-mode", "remote", "--router-address", f"127.0.0.1:{port}")
        url, _ = start_frontend(stack, plane_args, tmp_path, len(WORKERS), *address)
        result = Setup(KvCluster(url, worker_metrics), start_router, router_url)
        yield result


def prefix_requests(c: KvCluster, suffixes: range) -> tuple[dict[str, float], list[int]]:
    before = c.served()
    cached = [c.complete(suffix) for suffix in suffixes]
    return new_requests(before, c.served()), cached


def test_the_router_places_requests_and_the_frontend_falls_back_without_it(setup: Setup) -> None:
    c = setup.cluster
    router = setup.start_router()

    events = (c.kv_events_published(), setup.router_kv_events_applied())
    placed, cached = prefix_requests(c, range(1, 2))
    (owner,) = placed
    assert cached == [0]  # nobody holds the prefix yet
    c.wait_kv_events_applied(setup.router_kv_events_applied, events)  # over NATS
    placed, cached = prefix_requests(c, range(2, 8))
    assert placed == {owner: 6.0}, "prefix requests left the caching worker"
    assert cached == [len(PREFIX)] * 6
    assert setup.router_metric(DECISIONS, KV) == 7
    blocks = len(PREFIX) // 64
    assert setup.router_metric(OVERLAP, KV) == 6 * blocks
    assert c.frontend_metric(DECISIONS, LOCAL) == 0  # every decision was the router's

    # Without the router the frontend places requests itself, least-loaded: they succeed.
    router.send_signal(signal.SIGKILL)
    router.wait(timeout=10)
    placed, _ = prefix_requests(c, range(10, 16))
    assert sum(placed.values()) == 6
    assert c.frontend_metric(DECISIONS, LOCAL) == 6

    # A new router syncs its index from the workers' snapshots before routing, and the
    # frontend asks it again once its retry delay (1 s) has passed: only a request shows when,
    # so probe until one is the new router's decision, and count from there.
    setup.start_router()
    probes = itertools.count(1000)

    def routed_by_the_router() -> bool:
        c.complete(next(probes))
        return setup.router_metric(DECISIONS, KV) > 0  # the new router's counters start at 0

    wait_until(routed_by_the_router, "the frontend to route through the restarted router", 10, interval=0.1)
    decided, overlap = setup.router_metric(DECISIONS, KV), setup.router_metric(OVERLAP, KV)
    local = c.frontend_metric(DECISIONS, LOCAL)
    # (The fallback may have cached the prefix on other workers too: any of them will do.)
    placed, cached = prefix_requests(c, range(20, 24))
    assert sum(placed.values()) == 4
    assert cached == [len(PREFIX)] * 4
    assert setup.router_metric(DECISIONS, KV) - decided == 4
    assert setup.router_metric(OVERLAP, KV) - overlap == 4 * blocks
    assert c.frontend_metric(DECISIONS, LOCAL) == local, "every decision was the router's again"
