"""Issue 2's multi-process acceptance test: `weir frontend` and two `weir worker --backend mocker`
processes over real etcd and NATS. SIGKILL one worker: within its lease TTL the frontend stops
routing to it, and requests keep succeeding on the other throughout."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from backends.registry import DEFAULT_MODEL
from tests.cli.procs import wait_healthy, weir_process
from tests.cluster import LEASE_TTL, Cluster, Procs, planes, start_frontend, start_workers
from tests.servers import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

WORKERS = ("worker-a", "worker-b")
MIGRATED = f'model="{DEFAULT_MODEL}",reason="unavailable"'


class PingCluster(Cluster):
    def complete(self) -> None:
        reply = self.client.completions.create(
            model=DEFAULT_MODEL, prompt="ping", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].finish_reason == "length"


@pytest.fixture
def cluster(etcd_url: str, nats_url: str, tmp_path: Path) -> Iterator[tuple[PingCluster, Procs]]:
    plane_args = planes(etcd_url, nats_url, "cluster")
    with ExitStack() as stack:
        procs, workers = start_workers(stack, plane_args, tmp_path, WORKERS)
        url, procs["frontend"] = start_frontend(
            stack, plane_args, tmp_path, len(WORKERS), "--router-mode", "round-robin"
        )
        yield PingCluster(url, workers), procs


def test_killed_worker_stops_receiving_requests_within_lease_ttl(
    cluster: tuple[PingCluster, Procs],
) -> None:
    c, procs = cluster
    for _ in range(8):
        c.complete()
    # Round robin over two workers: both served.
    assert c.served_by("worker-a") == c.served_by("worker-b") == 4

    procs["worker-a"].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    # Until the lease expires the frontend still picks worker-a half of the time; those requests
    # fail over to worker-b before their first token, so the client sees no error.
    while c.known_workers() == 2:
        c.complete()
        assert time.monotonic() - killed < LEASE_TTL + 2.0, "worker-a still routable after its lease TTL"
    gone_after = time.monotonic() - killed
    assert gone_after <= LEASE_TTL + 2.0
    print(
        f"worker-a left the frontend {gone_after:.2f} s after SIGKILL; "
        f"{c.frontend_metric('weir_frontend_migrations_total', MIGRATED):.0f} requests failed over meanwhile"
    )

    # From now on nothing is routed to worker-a: no migrations, every request served by worker-b.
    migrations = c.frontend_metric("weir_frontend_migrations_total", MIGRATED)
    before = c.served_by("worker-b")
    for _ in range(10):
        c.complete()
    assert c.frontend_metric("weir_frontend_migrations_total", MIGRATED) == migrations
    assert c.served_by("worker-b") == before + 10
    assert c.frontend_metric("weir_frontend_workers") == 1

    # SIGTERM drains: the worker exits cleanly and leaves discovery at once, not after its TTL.
    procs["worker-b"].send_signal(signal.SIGTERM)
    assert procs["worker-b"].wait(timeout=20) == 0
    # Within a second: a drained worker deregisters, it does not wait for its lease.
    wait_until(lambda: c.known_workers() == 0, "the drained worker to deregister", 1.0)

    procs["frontend"].send_signal(signal.SIGTERM)
    assert procs["frontend"].wait(timeout=20) == 0


def test_deepinfer_worker_serves_in_cluster_mode(etcd_url: str, nats_url: str, tmp_path: Path) -> None:
    """`weir worker --backend deepinfer` on a tiny local checkpoint, behind `weir frontend`."""
    from backends.deepinfer.tiny import build_checkpoint

    model = build_checkpoint(tmp_path / "tiny-llama", "llama")
    plane_args = planes(etcd_url, nats_url, "deepinfer")
    port = free_port()
    with (
        weir_process(
            "worker",
            "--backend",
            "deepinfer",
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--device",
            "cpu",
            "--num-kv-blocks",
            "64",
            *plane_args,
            log=tmp_path / "worker.log",
        ) as worker,
        weir_process("frontend", *plane_args, "--port", str(port), log=tmp_path / "frontend.log") as frontend,
    ):
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, frontend, tmp_path / "frontend.log")
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 6
        assert "deepinfer serving tiny as aggregated" in (tmp_path / "worker.log").read_text()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
