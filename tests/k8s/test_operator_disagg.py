"""`weir scale` and `weir status` on a disaggregated release: helm/weir/examples/
disaggregated-mocker.yaml installed by `helm install` into a real kube-apiserver, discovery in
a real etcd. The prefill and the decode pool are sized apart, each under its own name, and
every output names the pool's role. As in test_operator.py, no controllers run: the tests
write pods and status where a kubelet would."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from kubernetes import client, config

from orchestrator.runtime.discovery import make_discovery
from orchestrator.runtime.protocol import Instance, ModelCard, Role
from tests.k8s.apiserver import ApiServer
from tests.k8s.helm import CHART, helm
from tests.k8s.test_operator import plain, weir, worker_pod

NS = "weir-disagg"
RELEASE = "dis"
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def kubeconfig(kube_api: ApiServer, helm_bin: str, etcd_url: str, nats_url: str) -> Iterator[str]:
    path = str(kube_api.kubeconfig)
    result = helm(
        helm_bin, "install", RELEASE, str(CHART), "--namespace", NS, "--create-namespace",
        "--kubeconfig", path, "-f", str(CHART / "examples" / "disaggregated-mocker.yaml"),
        "--set", f"etcd.enabled=false,etcd.endpoints={etcd_url}",
        "--set", f"nats.enabled=false,nats.url={nats_url}", check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    yield path
    helm(helm_bin, "uninstall", RELEASE, "--namespace", NS, "--kubeconfig", path, check=False)


@pytest.fixture(scope="module")
def api(kubeconfig: str) -> client.ApiClient:
    return config.new_client_from_config(kubeconfig, persist_config=False)


def kube_args(kubeconfig: str) -> list[str]:
    return ["--kubeconfig", kubeconfig, "--namespace", NS, "--release", RELEASE]


def replicas(api: client.ApiClient, pool: str) -> int:
    scale = client.AppsV1Api(api).read_namespaced_deployment_scale(f"dis-weir-pool-{pool}", NS)
    return int(plain(scale)["spec"]["replicas"])


def test_prefill_and_decode_pools_scale_apart(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, api: client.ApiClient
) -> None:
    result = weir(capsys, "scale", "prefill", "--replicas", "3", *kube_args(kubeconfig))
    assert result.rc == 0, result.err
    assert (
        f"scaled pool prefill (role prefill, deployment {NS}/dis-weir-pool-prefill) from 1 to 3 replicas"
        in result.out
    )
    assert (replicas(api, "prefill"), replicas(api, "decode")) == (3, 1)

    result = weir(capsys, "scale", "decode", "--replicas", "2", *kube_args(kubeconfig))
    assert result.rc == 0, result.err
    assert "scaled pool decode (role decode, deployment" in result.out and "from 1 to 2" in result.out
    assert (replicas(api, "prefill"), replicas(api, "decode")) == (3, 2)


def test_an_unknown_pool_lists_the_pools_with_their_roles(
    capsys: pytest.CaptureFixture[str], kubeconfig: str
) -> None:
    result = weir(capsys, "scale", "prefil", "--replicas", "1", *kube_args(kubeconfig))
    assert result.rc == 3
    assert "(pools there: decode (decode), prefill (prefill))" in result.err


def _worker_pod(api: client.ApiClient, pool: str, ip: str) -> str:
    name = f"dis-weir-pool-{pool}-7d9f-x2k4"
    worker_pod(client.CoreV1Api(api), name, pool, ip, namespace=NS, release=RELEASE, role=pool)
    return name


async def test_status_shows_each_pool_and_worker_with_its_role(
    kubeconfig: str, api: client.ApiClient, etcd_url: str
) -> None:
    apps = client.AppsV1Api(api)
    for pool, ready in (("prefill", 1), ("decode", 2)):  # what the Deployment controller would report
        apps.patch_namespaced_deployment_status(
            f"dis-weir-pool-{pool}", NS, {"status": {"replicas": ready, "readyReplicas": ready}}
        )
    pods = {
        "prefill": _worker_pod(api, "prefill", "10.8.0.1"),
        "decode": _worker_pod(api, "decode", "10.8.0.2"),
    }
    discovery = make_discovery(etcd_url, RELEASE)  # the weir namespace: the release name
    roles: tuple[tuple[Role, str], ...] = (("prefill", "10.8.0.1"), ("decode", "10.8.0.2"))
    for role, ip in roles:
        card = ModelCard(name=MODEL, role=role, backend="mocker", total_kv_blocks=4096)
        await discovery.register(
            Instance(instance_id=f"w-{role}", component="worker", address=f"{ip}:9000", card=card)
        )
    try:
        outputs = []
        for output in ("json", "table"):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "orchestrator.cli.main", "status", "-o", output, "--load-window", "0",
                *kube_args(kubeconfig), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            outputs.append(out.decode())
    finally:
        await discovery.close()
    status = json.loads(outputs[0])
    pools = {p["name"]: (p["role"], p["ready"]) for p in status["pools"]}
    assert pools == {"prefill": ("prefill", 1), "decode": ("decode", 2)}
    workers = {w["instance_id"]: (w["role"], w["pod"]) for w in status["workers"]}
    assert workers == {"w-prefill": ("prefill", pods["prefill"]), "w-decode": ("decode", pods["decode"])}
    assert status["roles"] == {"decode": 1, "prefill": 1}
    table = outputs[1].splitlines()
    assert any(line.split()[1:3] == ["prefill", "prefill"] for line in table if line.startswith("dis "))
    assert any(line.split()[1:3] == ["decode", "decode"] for line in table if line.startswith("dis "))
    assert table[-1] == "By role: decode 1, prefill 1"
