"""Multi-process clusters for tests: `weir worker --backend mocker` processes and a `weir
frontend` over real etcd and NATS, watched through their HTTP endpoints."""

from __future__ import annotations

import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai

from tests.cli.procs import wait_healthy, weir_process
from tests.servers import free_port
from tests.waiting import wait_until

Procs = dict[str, subprocess.Popen[bytes]]
LEASE_TTL = 2.0  # etcd's smallest lease with its default election timeout


def planes(etcd_url: str, nats_url: str, prefix: str) -> list[str]:
    """The cluster-plane flags, in a namespace of this test's own."""
    return ["--etcd", etcd_url, "--nats", nats_url, "--weir-namespace", f"{prefix}-{time.monotonic_ns()}"]


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from Prometheus text, 0 if absent; `labels` in any order
    ('a="x",b="y"', no commas inside values), empty for a sample without labels."""
    wanted = set(labels.split(","))
    for line in text.splitlines():
        if not labels and line.startswith(name + " "):
            return float(line[len(name) + 1 :])
        if labels and line.startswith(name + "{"):
            found, _, value = line[len(name) + 1 :].rpartition("} ")
            if set(found.split(",")) == wanted:
                return float(value)
    return 0.0


def known_workers(frontend: str) -> int:
    return int(httpx.get(f"{frontend}/health", timeout=5).json()["workers"])


def start_workers(
    stack: ExitStack, plane_args: list[str], tmp_path: Path, names: tuple[str, ...], speedup: float = 1000
) -> tuple[Procs, dict[str, str]]:
    """Mocker worker processes with instance ids `names`: their processes and metrics base URLs.
    `speedup` divides the mocker's simulated step times (1: about 6 ms per decode step)."""
    procs: Procs = {}
    metrics: dict[str, str] = {}
    for name in names:
        port = free_port()
        procs[name] = stack.enter_context(
            weir_process(
                "worker",
                *("--backend", "mocker", "--speedup", str(speedup)),
                *plane_args,
                *("--instance-id", name, "--lease-ttl", str(LEASE_TTL), "--metrics-port", str(port)),
                log=tmp_path / f"{name}.log",
            )
        )
        metrics[name] = f"http://127.0.0.1:{port}"
    return procs, metrics


def start_frontend(
    stack: ExitStack, plane_args: list[str], tmp_path: Path, workers: int, *args: str
) -> tuple[str, subprocess.Popen[bytes]]:
    """A frontend with `args`, once it is healthy and knows `workers` workers: its URL and process.
    One process unless `args` say otherwise: these tests check one router's decisions and its
    metrics, which `--processes N` replicates (tests/cli/test_frontend_processes.py covers N)."""
    port = free_port()
    log = tmp_path / "frontend.log"
    if "--processes" not in args:
        args = ("--processes", "1", *args)
    frontend = stack.enter_context(weir_process("frontend", *plane_args, "--port", str(port), *args, log=log))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, frontend, log)
    wait_until(lambda: known_workers(url) >= workers, f"the frontend to see {workers} workers", 60)
    return url, frontend


class Cluster:
    def __init__(self, frontend: str, workers: dict[str, str]) -> None:
        self.frontend = frontend
        self.workers = workers  # instance id -> metrics base URL
        self.client = openai.OpenAI(base_url=f"{frontend}/v1", api_key="unused", max_retries=0, timeout=30)

    def served_by(self, worker: str) -> float:
        """Requests `worker` finished well, from its own /metrics."""
        text = httpx.get(f"{self.workers[worker]}/metrics", timeout=5).text
        return metric(text, "weir_worker_requests_total", f'outcome="ok",worker="{worker}"')

    def known_workers(self) -> int:
        return known_workers(self.frontend)

    def frontend_metric(self, name: str, labels: str = "") -> float:
        return metric(httpx.get(f"{self.frontend}/metrics", timeout=5).text, name, labels)
