"""The chart's pods, run as local processes: each container's args and environment exactly as
rendered (ConfigMap via envFrom, env, downward-API pod IP), against real etcd and NATS. They
must find each other through the ConfigMap's addresses, pass their probes and serve a
completion; `weir status` then sees the worker and its load. Every example that runs on CPU is
run the same way, each of its Deployments a process, and serves a chat completion (handed from
a prefill worker to a decode worker, when the example has prefill pools)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import KvSnapshot
from orchestrator.runtime.request_plane import PlaneSecurity, RequestPlaneClient
from orchestrator.runtime.request_plane.security import client_tls_context
from orchestrator.runtime.request_plane.worker_client import TcpWorkerClient
from tests.certs import make_certs
from tests.cli.procs import weir_process
from tests.cluster import Cluster, metric
from tests.k8s.helm import CHART, Manifest, find, one, render
from tests.servers import free_port
from tests.waiting import wait_http_ok, wait_until

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
        elif "secretKeyRef" in var.get("valueFrom", {}):  # a Secret the chart rendered
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = base64.b64decode(
                one(manifests, "Secret", ref["name"])["data"][ref["key"]]
            ).decode()
        else:  # a Secret, another field: the processes would run without it, so say so
            pytest.fail(f"no local stand-in for the env var {var}")
    return env


@pytest.fixture
def pods(helm_bin: str, etcd_url: str, nats_url: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    api_port, probe_port, worker_port, metrics_port = free_port(), free_port(), free_port(), free_port()
    values: dict[str, Any] = {
        "etcd": {"enabled": False, "endpoints": etcd_url},
        "nats": {"enabled": False, "url": nats_url},
        "weirNamespace": f"chart-{os.getpid()}",
        "frontend": {"port": api_port, "probePort": probe_port, "routerMode": "round-robin"},
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
                               "probe_port": probe_port, "metrics_port": metrics_port, "procs": procs,
                               "etcd": etcd_url, "nats": nats_url}  # fmt: skip
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
    wait_http_ok(f"http://127.0.0.1:{pods['probe_port']}/live", 90, proc=frontend)
    wait_http_ok(f"http://127.0.0.1:{pods['probe_port']}/health", 90, proc=frontend)  # ready: it has a worker
    wait_http_ok(f"http://127.0.0.1:{pods['api_port']}/health", 90, proc=frontend)

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


# The examples this machine can run: CPU only, nothing to download. aggregated-deepinfer.yaml,
# disaggregated-deepinfer.yaml and external-planes.yaml serve Qwen3 checkpoints from a model
# claim on GPUs; those weights are not available offline, so they are linted, rendered and
# validated (test_chart_lint, test_chart_manifests, test_chart_examples) but not run here.
CPU_EXAMPLES = [CHART / "examples" / "mocker-cpu.yaml", CHART / "examples" / "disaggregated-mocker.yaml"]
# The pods' "cache" volume, here: the user cache, where the bundled model is converted once (a
# fresh directory per pod, as each pod's emptyDir is, would convert it again, 10-20 s apiece).
LOCAL_CACHE = Path.home() / ".cache"
PORT_FLAGS = ("--port", "--metrics-port", "--probe-port")


@dataclass
class LocalPod:
    """One Deployment's container as a process on this machine."""

    deployment: str
    component: str
    labels: dict[str, str]  # the pod template's
    args: list[str]  # after the image's entrypoint, `weir`
    env: dict[str, str]
    ports: dict[str, int]  # container port name -> the local port standing in for it
    readiness: Manifest  # the readinessProbe's httpGet

    def url(self, port_name: str) -> str:
        return f"http://127.0.0.1:{self.ports[port_name]}"


def _map_values(args: list[str], rewrite: Callable[[str, str], str]) -> list[str]:
    """Each `--flag=value` of `args` as `--flag=rewrite(flag, value)`."""
    out = []
    for arg in args:
        flag, eq, value = arg.partition("=")
        out.append(f"{flag}={rewrite(flag, value)}" if eq else arg)
    return out


def _local_path(value: str, mounts: dict[str, Path]) -> str:
    for mount, local in mounts.items():
        if value == mount or value.startswith(mount + "/"):
            return str(local) + value[len(mount) :]
    return value


def _fill_secret_volume(
    local: Path, volume: Manifest, manifests: list[Manifest], secrets: dict[str, dict[str, bytes]]
) -> None:
    """A secret volume's files as the kubelet writes them: each key of the Secret (one the chart
    rendered, or the test's stand-in for an existing one), or only its `items`."""
    name = volume["secret"]["secretName"]
    rendered = find(manifests, "Secret", name)
    if rendered:
        data = {key: base64.b64decode(value) for key, value in rendered[0]["data"].items()}
    elif name in secrets:
        data = secrets[name]
    else:  # the processes would start without its files, so say so
        pytest.fail(f"no local stand-in for the Secret {name}")
    for item in volume["secret"].get("items") or [{"key": key, "path": key} for key in data]:
        (local / item["path"]).write_bytes(data[item["key"]])


def _local_pod(
    manifests: list[Manifest],
    dep: Manifest,
    planes: dict[str, str],
    scratch: Path,
    secrets: dict[str, dict[str, bytes]],
) -> LocalPod:
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert "command" not in container, "the chart runs the image's entrypoint, `weir`"
    name = dep["metadata"]["name"]
    # Every port the pod listens on gets a free one (two pools both want 9000 and 9090).
    remap = {}
    for flag, _, value in (arg.partition("=") for arg in container["args"]):
        if flag in PORT_FLAGS:
            remap[value] = str(free_port())
    ports = {p["name"]: int(remap[str(p["containerPort"])]) for p in container["ports"]}
    mounts = {
        m["mountPath"]: LOCAL_CACHE if m["name"] == "cache" else scratch / name / m["name"]
        for m in container.get("volumeMounts", [])
    }
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        local = mounts[mount["mountPath"]]
        local.mkdir(parents=True, exist_ok=True)
        if "secret" in volumes[mount["name"]]:
            _fill_secret_volume(local, volumes[mount["name"]], manifests, secrets)
    env = container_env(manifests, container, pod_ip="127.0.0.1")
    assert planes.keys() <= env.keys(), "the chart passes etcd and NATS as WEIR_ETCD / WEIR_NATS"
    return LocalPod(
        deployment=name,
        component=dep["metadata"]["labels"]["app.kubernetes.io/component"],
        labels=dep["spec"]["template"]["metadata"]["labels"],
        args=_map_values(
            container["args"], lambda flag, v: remap[v] if flag in PORT_FLAGS else _local_path(v, mounts)
        ),
        env={key: _local_path(value, mounts) for key, value in env.items()} | planes,
        ports=ports,
        readiness=container["readinessProbe"]["httpGet"],
    )


def _service_address(address: str, manifests: list[Manifest], pods: list[LocalPod]) -> str:
    """`<service>.<namespace>.svc:<port>` as the local address of the pod the Service selects."""
    host, port = address.rsplit(":", 1)
    service = one(manifests, "Service", host.split(".")[0])
    (target,) = [p["targetPort"] for p in service["spec"]["ports"] if p["port"] == int(port)]
    (behind,) = [pod for pod in pods if service["spec"]["selector"].items() <= pod.labels.items()]
    return f"127.0.0.1:{behind.ports[target]}"


def local_pods(
    manifests: list[Manifest],
    etcd_url: str,
    nats_url: str,
    scratch: Path,
    secrets: dict[str, dict[str, bytes]] | None = None,
) -> list[LocalPod]:
    """Every rendered Deployment's container as it runs here: args, env (ConfigMap, values, pod
    IP 127.0.0.1) and probes as rendered, except what cannot be the same on one machine: etcd
    and NATS are the test's, each listening port is a free one, a Service address is the local
    port of the pod behind it, volume mounts are local directories (a secret volume's holding
    its Secret's files: a rendered Secret's, or `secrets[name]` for one that must exist)."""
    planes = {"WEIR_ETCD": etcd_url, "WEIR_NATS": nats_url}
    pods = [
        _local_pod(manifests, dep, planes, scratch, secrets or {}) for dep in find(manifests, "Deployment")
    ]
    for pod in pods:  # now that every pod has its local ports
        pod.args = _map_values(
            pod.args,
            lambda flag, v: _service_address(v, manifests, pods) if flag == "--router-address" else v,
        )
    return pods


def _start(stack: ExitStack, pods: list[LocalPod], logs: Path, workers: int) -> Cluster:
    """Each pod a process (stopped when `stack` closes), all ready, the frontend seeing `workers`."""
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    for pod in pods:
        log = logs / f"{pod.deployment}.log"
        procs[pod.deployment] = (stack.enter_context(weir_process(*pod.args, log=log, env=pod.env)), log)
    for pod in pods:
        proc, log = procs[pod.deployment]
        probe = pod.url(pod.readiness["port"]) + pod.readiness["path"]
        wait_http_ok(probe, 120, proc=proc, log=log, interval=0.1)
    (frontend,) = [pod for pod in pods if pod.component == "frontend"]
    cluster = Cluster(frontend.url("http"), {})
    wait_until(lambda: cluster.known_workers() == workers, f"the frontend to see {workers} workers", 60)
    return cluster


def _sample_sum(text: str, name: str, labels: dict[str, str]) -> float:
    """The sum of `name`'s samples in Prometheus text whose labels include `labels`."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def check_handovers(cluster: Cluster, pods: list[LocalPod], model: str, pools: list[Manifest]) -> None:
    """One request served: disaggregated, its KV pulled by a decode worker, when the example
    has a prefill pool (its frontend sends every prefill there); whole otherwise."""
    handovers = 1 if any(pool["role"] == "prefill" for pool in pools) else 0
    decided = f'model="{model}",outcome="disaggregated"'
    assert cluster.frontend_metric("weir_frontend_disagg_decisions_total", decided) == handovers
    assert cluster.frontend_metric("weir_frontend_disagg_fallbacks_total", f'model="{model}"') == 0
    workers = [
        httpx.get(pod.url("metrics") + "/metrics", timeout=5).text
        for pod in pods
        if pod.component == "worker"
    ]
    pulled = {"direction": "pulled", "outcome": "ok"}
    assert sum(_sample_sum(text, "weir_worker_kv_transfers_total", pulled) for text in workers) == handovers


WITH_ROUTER = {"router.enabled": "true", "clusterSecret.value": "chart-test-cluster-secret"}


@pytest.mark.parametrize(
    ("example", "sets"),
    # The router cases also close the request plane: every process gets the cluster secret.
    [*((path, {}) for path in CPU_EXAMPLES), *((path, WITH_ROUTER) for path in CPU_EXAMPLES)],
    ids=[*(path.name for path in CPU_EXAMPLES), *(f"{path.name}+router.enabled" for path in CPU_EXAMPLES)],
)
def test_cpu_example_runs_and_serves_a_chat(
    helm_bin: str, etcd_url: str, nats_url: str, tmp_path: Path, example: Path, sets: dict[str, str]
) -> None:
    """The example's Deployments, one process each (replicas aside), pass their readiness
    probes and serve a chat completion through the rendered frontend: every pool's worker is
    routable, a prefill pool's worker hands the prompt's KV to a decode pool's, and the
    standalone router, when enabled, makes the (whole-request or decode) decision."""
    pools = yaml.safe_load(example.read_text())["pools"]
    (model,) = {pool["model"] for pool in pools}
    release = f"run{time.monotonic_ns() % 10**9}"  # also its weir namespace, apart from other tests'
    manifests = render(helm_bin, example, sets=sets, release=release)
    pods = local_pods(manifests, etcd_url, nats_url, tmp_path)
    with_router = "router.enabled" in sets
    assert sorted(pod.component for pod in pods) == sorted(
        ["frontend", *["worker"] * len(pools), *(["router"] * with_router)]
    )
    with ExitStack() as stack:
        cluster = _start(stack, pods, tmp_path, workers=len(pools))
        reply = cluster.client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage is not None and reply.usage.completion_tokens == 8
        check_handovers(cluster, pods, model, pools)
        for pod in pods:
            if pod.component == "router":
                text = httpx.get(pod.url("metrics") + "/metrics", timeout=5).text
                assert metric(text, "weir_router_decisions_total", f'model="{model}",mode="kv"') == 1


def _kv_snapshot(address: str, security: PlaneSecurity) -> KvSnapshot:
    async def call() -> KvSnapshot:
        client = RequestPlaneClient(connect_timeout=2.0, security=security)
        try:
            return await TcpWorkerClient(client, address).kv_snapshot()
        finally:
            await client.close()

    return asyncio.run(call())


@pytest.mark.parametrize("example", CPU_EXAMPLES, ids=lambda p: p.name)
def test_cpu_example_serves_over_request_plane_tls(
    helm_bin: str, etcd_url: str, nats_url: str, tmp_path: Path, example: Path
) -> None:
    """requestPlaneTLS with a kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt; made here) in
    the mounts as rendered: the workers and the router serve TLS, the frontend asks the router
    and streams a chat from a worker over it (a decode worker pulling the prefill's KV over it
    too), and a plaintext caller is refused at a worker's port that a caller trusting ca.crt is
    answered on."""
    pools = yaml.safe_load(example.read_text())["pools"]
    (model,) = {pool["model"] for pool in pools}
    certs = make_certs(tmp_path)
    secret = {
        "tls.crt": certs.cert.read_bytes(),
        "tls.key": certs.key.read_bytes(),
        "ca.crt": certs.ca.read_bytes(),
    }
    sets = {
        "router.enabled": "true",
        "requestPlaneTLS.enabled": "true",
        "requestPlaneTLS.secretName": "weir-tls",
    }
    release = f"tls{time.monotonic_ns() % 10**9}"
    manifests = render(helm_bin, example, sets=sets, release=release)
    pods = local_pods(manifests, etcd_url, nats_url, tmp_path, secrets={"weir-tls": secret})
    for pod in pods:  # each process reads the certificates where its mount stands in
        assert [a for a in pod.args if a.startswith("--tls-")], pod.deployment
    with ExitStack() as stack:
        cluster = _start(stack, pods, tmp_path, workers=len(pools))
        stream = cluster.client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 8
        check_handovers(cluster, pods, model, pools)
        (router,) = [pod for pod in pods if pod.component == "router"]
        text = httpx.get(router.url("metrics") + "/metrics", timeout=5).text
        # The router decided, so the frontend reached it over TLS (unreachable, it decides itself).
        assert metric(text, "weir_router_decisions_total", f'model="{model}",mode="kv"') == 1

        for worker in (pod for pod in pods if pod.component == "worker"):
            address = f"127.0.0.1:{worker.ports['requests']}"
            trusting = PlaneSecurity(client_tls=client_tls_context(str(certs.ca)))
            assert _kv_snapshot(address, trusting) is not None
            with pytest.raises(EngineError):
                _kv_snapshot(address, PlaneSecurity())
