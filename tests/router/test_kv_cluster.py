"""Issue 4's multi-process acceptance test: `weir frontend --router-mode kv` and three
`weir worker --backend mocker` processes over real etcd and NATS. Requests sharing a long
prefix land on the worker that cached it (learned from its KV events); after that worker is
SIGKILLed, discovery drops it, the index forgets its blocks, and the prefix goes elsewhere."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from backends.registry import DEFAULT_MODEL
from tests.cli.procs import wait_healthy, weir_process
from tests.servers import free_port

Procs = dict[str, subprocess.Popen[bytes]]
LEASE_TTL = 2.0
WORKERS = ("worker-a", "worker-b", "worker-c")
PREFIX = [(7 * i) % 900 + 10 for i in range(2048)]  # 32 blocks of 64 tokens

pytestmark = pytest.mark.slow


def metric(text: str, name: str, labels: str) -> float:
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


class KvCluster:
    def __init__(self, frontend: str, workers: dict[str, str]) -> None:
        self.frontend = frontend
        self.workers = workers  # instance id -> metrics base URL
        self.client = openai.OpenAI(base_url=f"{frontend}/v1", api_key="unused", max_retries=0, timeout=30)

    def complete(self, suffix: int) -> int:
        """One request on the shared prefix; the prompt tokens the worker found cached."""
        prompt = [*PREFIX, suffix, suffix + 1]
        reply = self.client.completions.create(
            model=DEFAULT_MODEL, prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None
        details = reply.usage.prompt_tokens_details
        return details.cached_tokens or 0 if details is not None else 0

    def served(self) -> dict[str, float]:
        counts = {}
        for worker, url in self.workers.items():
            try:
                text = httpx.get(f"{url}/metrics", timeout=5).text
            except httpx.TransportError:
                continue  # a killed worker
            counts[worker] = metric(text, "weir_worker_requests_total", f'outcome="ok",worker="{worker}"')
        return counts

    def known_workers(self) -> int:
        return int(httpx.get(f"{self.frontend}/health", timeout=5).json()["workers"])


@pytest.fixture
def cluster(etcd_url: str, nats_url: str, tmp_path: Path) -> Iterator[tuple[KvCluster, Procs]]:
    namespace = f"kv-{time.monotonic_ns()}"
    planes = ["--etcd", etcd_url, "--nats", nats_url, "--namespace", namespace]
    with ExitStack() as stack:
        procs: Procs = {}
        metrics: dict[str, str] = {}
        for name in WORKERS:
            port = free_port()
            procs[name] = stack.enter_context(
                weir_process(
                    "worker",
                    *("--backend", "mocker", "--speedup", "1000"),
                    *planes,
                    *("--instance-id", name, "--lease-ttl", str(LEASE_TTL), "--metrics-port", str(port)),
                    log=tmp_path / f"{name}.log",
                )
            )
            metrics[name] = f"http://127.0.0.1:{port}"
        port = free_port()
        log = tmp_path / "frontend.log"
        frontend = stack.enter_context(
            weir_process("frontend", *planes, "--port", str(port), "--router-mode", "kv", log=log)
        )
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, frontend, log)
        result = KvCluster(url, metrics)
        deadline = time.monotonic() + 60
        while result.known_workers() < len(WORKERS):
            assert time.monotonic() < deadline, "the frontend never saw all workers"
            time.sleep(0.1)
        yield result, procs


def new_requests(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {w: after[w] - before.get(w, 0.0) for w in after if after[w] != before.get(w, 0.0)}


def test_shared_prefix_follows_the_cache_and_forgets_a_killed_worker(
    cluster: tuple[KvCluster, Procs],
) -> None:
    c, procs = cluster
    before = c.served()
    assert c.complete(1) == 0  # nobody holds the prefix yet
    (owner,) = new_requests(before, c.served())
    time.sleep(0.5)  # the owner's KV events reach the frontend over NATS

    before = c.served()
    cached = [c.complete(suffix) for suffix in range(2, 8)]
    assert new_requests(before, c.served()) == {owner: 6.0}, "prefix requests left the caching worker"
    assert all(n == len(PREFIX) for n in cached), cached

    procs[owner].send_signal(signal.SIGKILL)
    procs[owner].wait(timeout=10)
    deadline = time.monotonic() + LEASE_TTL + 5
    while c.known_workers() == len(WORKERS):
        assert time.monotonic() < deadline, f"{owner} still registered after its lease TTL"
        time.sleep(0.1)

    # The index forgot the owner's blocks: the first request finds no cache anywhere, lands
    # on a survivor, and the prefix then sticks to that survivor.
    before = c.served()
    assert c.complete(100) == 0
    (heir,) = new_requests(before, c.served())
    assert heir != owner
    time.sleep(0.5)
    before = c.served()
    cached = [c.complete(suffix) for suffix in range(101, 105)]
    assert new_requests(before, c.served()) == {heir: 4.0}
    assert all(n == len(PREFIX) for n in cached), cached
