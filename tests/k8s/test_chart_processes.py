"""The chart's pods, run as local processes: each container's args and environment exactly as
rendered (ConfigMap via envFrom, env, downward-API pod IP), against real etcd and NATS. They
must find each other through the ConfigMap's addresses, pass their probes and serve a
completion; `weir status` then sees the worker and its load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.k8s.helm import Manifest, find, one, render
from tests.servers import free_port
from tests.waiting import wait_http_ok

pytestmark = pytest.mark.slow


def container_env(manifests: list[Manifest], container: Manifest, pod_ip: str) -> dict[str, str]:
    """What the kubelet would put in the container's environment."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env |= one(manifests, "ConfigMap", source["configMapRef"]["name"])["data"]
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = pod_ip
    return env


@pytest.fixture
def pods(helm_bin: str, etcd_url: str, nats_url: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    api_port, worker_port, metrics_port = free_port(), free_port(), free_port()
    values: dict[str, Any] = {
        "etcd": {"enabled": False, "endpoints": etcd_url},
        "nats": {"enabled": False, "url": nats_url},
        "weirNamespace": f"chart-{os.getpid()}",
        "frontend": {"port": api_port, "routerMode": "round-robin"},
        # The converted bundled model already sits under ~/.cache/weir: mount "the cache" there.
        "poolDefaults": {"cache": {"mountPath": str(Path.home() / ".cache")}},
        "pools": [{"name": "agg", "role": "aggregated", "backend": "mocker", "model": "smollm2-135m-instruct",
                   "replicas": 1, "port": worker_port, "metricsPort": metrics_port,
                   "args": ["--speedup=100"]}],
    }  # fmt: skip
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    manifests = render(helm_bin, values_file)
    procs: list[subprocess.Popen[bytes]] = []
    started: dict[str, Any] = {"namespace": values["weirNamespace"], "api_port": api_port,
                               "metrics_port": metrics_port, "procs": procs, "etcd": etcd_url,
                               "nats": nats_url}  # fmt: skip
    try:
        for name in ("r-weir-pool-agg", "r-weir-frontend"):
            container = find(manifests, "Deployment", name)[0]["spec"]["template"]["spec"]["containers"][0]
            env = {"PATH": os.environ["PATH"], "HOME": str(Path.home()), "PYTHONUNBUFFERED": "1"}
            env |= container_env(manifests, container, pod_ip="127.0.0.1")
            with (tmp_path / f"{name}.log").open("wb") as log:
                argv = [sys.executable, "-m", "orchestrator.cli.main", *container["args"]]
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        yield started
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_rendered_pods_find_each_other_and_serve(pods: dict[str, Any]) -> None:
    worker, frontend = pods["procs"]
    # The probes the chart declares.
    wait_http_ok(f"http://127.0.0.1:{pods['metrics_port']}/live", 90, proc=worker)
    wait_http_ok(f"http://127.0.0.1:{pods['metrics_port']}/health", 90, proc=worker)
    wait_http_ok(f"http://127.0.0.1:{pods['api_port']}/live", 90, proc=frontend)
    wait_http_ok(f"http://127.0.0.1:{pods['api_port']}/health", 90, proc=frontend)  # ready: it has a worker

    reply = httpx.post(
        f"http://127.0.0.1:{pods['api_port']}/v1/completions",
        json={"model": "smollm2-135m-instruct", "prompt": "hello", "max_tokens": 8, "ignore_eos": True},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8

    status = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.main", "status", "-o", "json", "--etcd", pods["etcd"],
         "--nats", pods["nats"], "--weir-namespace", pods["namespace"], "--kubeconfig", "/nonexistent"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    report = json.loads(status.stdout)
    # No Kubernetes here (exit 5 for that part), but discovery and load are read all the same.
    assert status.returncode == 5, status.stderr
    (entry,) = report["workers"]
    assert entry["model"] == "smollm2-135m-instruct"
    assert entry["backend"] == "mocker" and entry["role"] == "aggregated"
    assert entry["address"].startswith("127.0.0.1:")
    assert entry["state"] == "serving"
    assert entry["load"]["total_blocks"] > 0
