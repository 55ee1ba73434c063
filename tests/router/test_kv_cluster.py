"""Issue 4's multi-process acceptance test: `weir frontend --router-mode kv` and three
`weir worker --backend mocker` processes over real etcd and NATS. Requests sharing a long
prefix land on the worker that cached it (learned from its KV events); after that worker is
SIGKILLed, discovery drops it, the index forgets its blocks, and the prefix goes elsewhere."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from backends.registry import DEFAULT_MODEL
from tests.cluster import LEASE_TTL, Procs, planes, start_frontend, start_workers
from tests.router.cluster import PREFIX, WORKERS, KvCluster, new_requests
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def frontend_kv_events_applied(c: KvCluster) -> float:
    return c.frontend_metric("weir_router_kv_events_applied_total", f'model="{DEFAULT_MODEL}"')


@pytest.fixture
def cluster(etcd_url: str, nats_url: str, tmp_path: Path) -> Iterator[tuple[KvCluster, Procs]]:
    plane_args = planes(etcd_url, nats_url, "kv")
    with ExitStack() as stack:
        procs, metrics = start_workers(stack, plane_args, tmp_path, WORKERS)
        url, _ = start_frontend(stack, plane_args, tmp_path, len(WORKERS), "--router-mode", "kv")
        yield KvCluster(url, metrics), procs


def test_shared_prefix_follows_the_cache_and_forgets_a_killed_worker(
    cluster: tuple[KvCluster, Procs],
) -> None:
    c, procs = cluster
    before, events = c.served(), (c.kv_events_published(), frontend_kv_events_applied(c))
    assert c.complete(1) == 0  # nobody holds the prefix yet
    (owner,) = new_requests(before, c.served())
    c.wait_kv_events_applied(lambda: frontend_kv_events_applied(c), events)  # over NATS

    before = c.served()
    cached = [c.complete(suffix) for suffix in range(2, 8)]
    assert new_requests(before, c.served()) == {owner: 6.0}, "prefix requests left the caching worker"
    assert all(n == len(PREFIX) for n in cached), cached

    procs[owner].send_signal(signal.SIGKILL)
    procs[owner].wait(timeout=10)
    wait_until(lambda: c.known_workers() < len(WORKERS), f"{owner}'s lease to expire", LEASE_TTL + 5)

    # The index forgot the owner's blocks: the first request finds no cache anywhere, lands
    # on a survivor, and the prefix then sticks to that survivor.
    before, events = c.served(), (c.kv_events_published(), frontend_kv_events_applied(c))
    assert c.complete(100) == 0
    (heir,) = new_requests(before, c.served())
    assert heir != owner
    c.wait_kv_events_applied(lambda: frontend_kv_events_applied(c), events)
    before = c.served()
    cached = [c.complete(suffix) for suffix in range(101, 105)]
    assert new_requests(before, c.served()) == {heir: 4.0}
    assert all(n == len(PREFIX) for n in cached), cached
