"""Multi-process KV-routing clusters for tests: mocker workers, a frontend, real etcd/NATS.

Shared by `test_kv_cluster.py` (the frontend routes by itself) and `test_service.py` (the
frontend asks a standalone `weir router`)."""

from __future__ import annotations

import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai

from backends.registry import DEFAULT_MODEL
from tests.cli.procs import wait_healthy, weir_process
from tests.servers import free_port
from tests.waiting import wait_until

Procs = dict[str, subprocess.Popen[bytes]]
LEASE_TTL = 2.0
WORKERS = ("worker-a", "worker-b", "worker-c")
PREFIX = [(7 * i) % 900 + 10 for i in range(2048)]  # 32 blocks of 64 tokens


def metric(text: str, name: str, labels: str) -> float:
    """One sample's value from Prometheus text, 0 if absent; `labels` in any order
    ('a="x",b="y"', no commas inside values)."""
    wanted = set(labels.split(","))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            found, _, value = line[len(name) + 1 :].rpartition("} ")
            if set(found.split(",")) == wanted:
                return float(value)
    return 0.0


def planes(etcd_url: str, nats_url: str, prefix: str) -> list[str]:
    return ["--etcd", etcd_url, "--nats", nats_url, "--namespace", f"{prefix}-{time.monotonic_ns()}"]


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

    def frontend_metric(self, name: str, labels: str) -> float:
        return metric(httpx.get(f"{self.frontend}/metrics", timeout=5).text, name, labels)


def start_workers(stack: ExitStack, plane_args: list[str], tmp_path: Path) -> tuple[Procs, dict[str, str]]:
    """`WORKERS` as mocker worker processes: their processes and metrics base URLs."""
    procs: Procs = {}
    metrics: dict[str, str] = {}
    for name in WORKERS:
        port = free_port()
        procs[name] = stack.enter_context(
            weir_process(
                "worker",
                *("--backend", "mocker", "--speedup", "1000"),
                *plane_args,
                *("--instance-id", name, "--lease-ttl", str(LEASE_TTL), "--metrics-port", str(port)),
                log=tmp_path / f"{name}.log",
            )
        )
        metrics[name] = f"http://127.0.0.1:{port}"
    return procs, metrics


def start_frontend(
    stack: ExitStack, plane_args: list[str], tmp_path: Path, workers: dict[str, str], *args: str
) -> KvCluster:
    """A frontend with `args`, once it is healthy and knows every worker."""
    port = free_port()
    log = tmp_path / "frontend.log"
    frontend = stack.enter_context(weir_process("frontend", *plane_args, "--port", str(port), *args, log=log))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, frontend, log)
    cluster = KvCluster(url, workers)
    wait_until(lambda: cluster.known_workers() >= len(WORKERS), "the frontend to see all workers", 60)
    return cluster


def new_requests(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {w: after[w] - before.get(w, 0.0) for w in after if after[w] != before.get(w, 0.0)}
