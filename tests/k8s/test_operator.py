"""`weir scale` and `weir status` against a real kube-apiserver, with the chart installed by
`helm install` and discovery in a real etcd. No controllers run: Deployments never get pods
by themselves, so tests write `status` (ready replicas, pod IPs) through the status subresource
the way a kubelet and the Deployment controller would."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from kubernetes import client, config

from orchestrator.cli.main import main
from orchestrator.runtime.discovery import drain_key, make_discovery
from orchestrator.runtime.events import make_event_plane
from orchestrator.runtime.protocol import Instance, LoadReport, ModelCard, subject
from tests.k8s.apiserver import ApiServer
from tests.k8s.helm import CHART, helm
from tests.servers import free_port

NS = "weir-ops"
RELEASE = "ops"


@dataclass(frozen=True)
class Release:
    api: ApiServer
    kubeconfig: str
    etcd: str
    nats: str


@dataclass(frozen=True)
class Result:
    rc: int
    out: str
    err: str


def weir(capsys: pytest.CaptureFixture[str], *argv: str) -> Result:
    rc = main(list(argv))
    captured = capsys.readouterr()
    return Result(rc, captured.out, captured.err)


@pytest.fixture(scope="module")
def release(kube_api: ApiServer, helm_bin: str, etcd_url: str, nats_url: str) -> Iterator[Release]:
    """The mocker example installed by helm, its addresses pointing at the test's etcd and NATS,
    and the operator Role bound to the user "operator"."""
    kubeconfig = str(kube_api.kubeconfig)
    installed = Release(kube_api, kubeconfig, etcd_url, nats_url)
    result = helm(helm_bin, "install", *chart_args(installed), "--create-namespace", check=False)
    assert result.returncode == 0, result.stderr
    yield installed
    helm(helm_bin, "uninstall", RELEASE, "--namespace", NS, "--kubeconfig", kubeconfig, check=False)


def chart_args(release: Release, *extra: str) -> list[str]:
    return [
        RELEASE, str(CHART), "--namespace", NS, "--kubeconfig", release.kubeconfig,
        "-f", str(CHART / "examples" / "mocker-cpu.yaml"),
        "--set", f"etcd.enabled=false,etcd.endpoints={release.etcd}",
        "--set", f"nats.enabled=false,nats.url={release.nats}",
        "--set", "operatorRole.subjects[0].kind=User,operatorRole.subjects[0].name=operator",
        "--set", "operatorRole.subjects[0].apiGroup=rbac.authorization.k8s.io",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def apps(release: Release) -> client.AppsV1Api:
    return client.AppsV1Api(config.new_client_from_config(release.kubeconfig, persist_config=False))


@pytest.fixture(scope="module")
def core(release: Release) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(release.kubeconfig, persist_config=False))


def plain(obj: object) -> dict[str, Any]:
    """An API object as the JSON the server sent (camelCase), free of the client's Optional types."""
    return cast(dict[str, Any], client.ApiClient().sanitize_for_serialization(obj))


def kube_args(release: Release, kubeconfig: str | None = None) -> list[str]:
    return ["--kubeconfig", kubeconfig or release.kubeconfig, "--namespace", NS, "--release", RELEASE]


def test_helm_installed_one_deployment_per_pool(apps: client.AppsV1Api) -> None:
    deployments = {d["metadata"]["name"]: d for d in plain(apps.list_namespaced_deployment(NS))["items"]}
    assert set(deployments) == {"ops-weir-frontend", "ops-weir-pool-extra", "ops-weir-pool-main"}
    main = deployments["ops-weir-pool-main"]
    assert main["spec"]["replicas"] == 2
    assert main["metadata"]["labels"]["weir.dev/role"] == "aggregated"
    assert main["metadata"]["labels"]["weir.dev/backend"] == "mocker"


def test_scale_sets_replicas_through_the_scale_subresource(
    capsys: pytest.CaptureFixture[str], release: Release, apps: client.AppsV1Api
) -> None:
    result = weir(capsys, "scale", "main", "--replicas", "5", *kube_args(release))
    assert result.rc == 0, result.err
    assert (
        "scaled pool main (role aggregated, deployment weir-ops/ops-weir-pool-main) from 2 to 5 replicas"
        in result.out
    )
    assert plain(apps.read_namespaced_deployment_scale("ops-weir-pool-main", NS))["spec"]["replicas"] == 5
    assert apps.read_namespaced_deployment("ops-weir-pool-main", NS).spec.replicas == 5
    # The other pool is untouched.
    assert apps.read_namespaced_deployment("ops-weir-pool-extra", NS).spec.replicas == 1

    result = weir(capsys, "scale", "main", "--replicas", "0", *kube_args(release))
    assert result.rc == 0, result.err
    assert apps.read_namespaced_deployment("ops-weir-pool-main", NS).spec.replicas == 0


def test_dry_run_changes_nothing(
    capsys: pytest.CaptureFixture[str], release: Release, apps: client.AppsV1Api
) -> None:
    before = apps.read_namespaced_deployment("ops-weir-pool-extra", NS).spec.replicas
    result = weir(capsys, "scale", "extra", "--replicas", "7", "--dry-run", *kube_args(release))
    assert result.rc == 0, result.err
    assert (
        "dry run: would scale pool extra (role aggregated, deployment weir-ops/ops-weir-pool-extra) "
        f"from {before} to 7" in (result.out)
    )
    assert apps.read_namespaced_deployment("ops-weir-pool-extra", NS).spec.replicas == before


def test_unknown_pool_is_a_clear_error(capsys: pytest.CaptureFixture[str], release: Release) -> None:
    result = weir(capsys, "scale", "mian", "--replicas", "1", *kube_args(release))
    assert result.rc == 3
    assert (
        "no pool named 'mian' in namespace weir-ops, release ops "
        "(pools there: extra (aggregated), main (aggregated))" in result.err
    )


def test_bad_replica_count_is_a_usage_error(capsys: pytest.CaptureFixture[str], release: Release) -> None:
    with pytest.raises(SystemExit) as exit_info:
        weir(capsys, "scale", "main", "--replicas", "-1", *kube_args(release))
    assert exit_info.value.code == 2
    assert "must be 0 or more" in capsys.readouterr().err


def test_missing_permission_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], release: Release, tmp_path: Path
) -> None:
    nobody = release.api.write_kubeconfig(tmp_path / "nobody", "nobody", "nobody-token")
    for argv in (["scale", "main", "--replicas", "3"], ["status", "--no-discovery"]):
        result = weir(capsys, *argv, *kube_args(release, str(nobody)))
        assert result.rc == 4, result
        assert "permission denied (403)" in result.err
        assert 'User "nobody" cannot list resource "deployments"' in result.err


def test_the_chart_operator_role_is_enough(
    capsys: pytest.CaptureFixture[str], release: Release, apps: client.AppsV1Api, tmp_path: Path
) -> None:
    operator = str(release.api.write_kubeconfig(tmp_path / "operator", "operator", "operator-token"))
    result = weir(capsys, "scale", "extra", "--replicas", "2", *kube_args(release, operator))
    assert result.rc == 0, result.err
    assert apps.read_namespaced_deployment("ops-weir-pool-extra", NS).spec.replicas == 2
    result = weir(capsys, "status", "-o", "json", "--load-window", "0", *kube_args(release, operator))
    assert result.rc == 0, result.err
    assert json.loads(result.out)["discovery"]["source"] == "ConfigMap weir-ops/ops-weir-config"


def test_unreachable_api_server_fails_fast(
    capsys: pytest.CaptureFixture[str], release: Release, tmp_path: Path
) -> None:
    dead = tmp_path / "dead"
    dead.write_text(
        release.api.kubeconfig.read_text().replace(release.api.url, f"https://127.0.0.1:{free_port()}")
    )
    started = time.monotonic()
    result = weir(capsys, "scale", "main", "--replicas", "1", *kube_args(release, str(dead)))
    assert result.rc == 5
    assert "is unreachable" in result.err and "Connection refused" in result.err
    assert time.monotonic() - started < 15


def test_missing_kubeconfig(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    result = weir(capsys, "scale", "main", "--replicas", "1", "--kubeconfig", str(tmp_path / "none"))
    assert result.rc == 5
    assert "does not exist" in result.err


def test_status_lists_pools_with_desired_and_ready(
    capsys: pytest.CaptureFixture[str], release: Release, apps: client.AppsV1Api
) -> None:
    apps.patch_namespaced_deployment_scale("ops-weir-pool-main", NS, {"spec": {"replicas": 3}})
    # What the Deployment controller would report once two of three pods pass readiness.
    apps.patch_namespaced_deployment_status(
        "ops-weir-pool-main", NS, {"status": {"replicas": 3, "readyReplicas": 2, "availableReplicas": 2}}
    )
    result = weir(capsys, "status", "-o", "json", "--no-discovery", *kube_args(release))
    assert result.rc == 0, result.err
    pools = {p["name"]: p for p in json.loads(result.out)["pools"]}
    assert set(pools) == {"extra", "main"}
    assert (
        pools["main"] | {"desired": 3, "ready": 2, "role": "aggregated", "backend": "mocker"} == pools["main"]
    )
    assert pools["extra"]["ready"] == 0

    table = weir(capsys, "status", "--no-discovery", *kube_args(release)).out
    header, *rows = table.splitlines()[1:]
    assert header.split() == ["RELEASE", "POOL", "ROLE", "BACKEND", "DESIRED", "READY", "DEPLOYMENT"]
    assert ["ops", "main", "aggregated", "mocker", "3", "2", "ops-weir-pool-main"] in [
        r.split() for r in rows
    ]


def test_two_releases_need_release_flag(
    capsys: pytest.CaptureFixture[str], release: Release, helm_bin: str
) -> None:
    result = helm(
        helm_bin, "install", "ops2", str(CHART), "--namespace", NS, "--kubeconfig", release.kubeconfig,
        "-f", str(CHART / "examples" / "mocker-cpu.yaml"), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    try:
        ambiguous = weir(
            capsys, "scale", "main", "--replicas", "1", "--kubeconfig", release.kubeconfig, "-n", NS
        )
        assert ambiguous.rc == 2
        assert "pool 'main' exists in several releases" in ambiguous.err and "--release" in ambiguous.err
        chosen = weir(capsys, "scale", "main", "--replicas", "1", "--kubeconfig", release.kubeconfig,
                      "-n", NS, "--release", "ops2")  # fmt: skip
        assert chosen.rc == 0 and "ops2-weir-pool-main" in chosen.out
    finally:
        helm(
            helm_bin, "uninstall", "ops2", "--namespace", NS, "--kubeconfig", release.kubeconfig, check=False
        )


def worker_pod(
    core: client.CoreV1Api,
    name: str,
    pool: str,
    ip: str,
    *,
    namespace: str = NS,
    release: str = RELEASE,
    role: str | None = None,
) -> None:
    """A pod of `pool` as its ReplicaSet and kubelet would leave it: labelled, running, an IP."""
    labels = {"app.kubernetes.io/name": "weir", "app.kubernetes.io/instance": release,
              "app.kubernetes.io/component": "worker", "weir.dev/pool": pool}  # fmt: skip
    if role is not None:
        labels["weir.dev/role"] = role
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1PodSpec(containers=[client.V1Container(name="worker", image="weir")]),
    )
    core.create_namespaced_pod(namespace, pod)
    # The kubelet's part: the pod runs and has an IP.
    core.patch_namespaced_pod_status(
        name, namespace, {"status": {"podIP": ip, "podIPs": [{"ip": ip}], "phase": "Running"}}
    )


async def test_status_shows_registered_workers_with_load(release: Release, core: client.CoreV1Api) -> None:
    worker_pod(core, "ops-weir-pool-main-a", "main", "10.9.0.1")
    discovery = make_discovery(release.etcd, RELEASE)
    events = make_event_plane(release.nats)
    card = ModelCard(name="mock-model", role="aggregated", backend="mocker", total_kv_blocks=16384)
    await discovery.register(
        Instance(instance_id="w-a", component="worker", address="10.9.0.1:9000", card=card)
    )
    await discovery.register(
        Instance(instance_id="w-b", component="worker", address="10.9.0.2:9000", card=card, draining=True)
    )
    reports = [
        LoadReport(
            worker_id="w-a", active_requests=3, waiting_requests=1, active_blocks=120, total_blocks=16384
        ),
        LoadReport(worker_id="w-b", active_requests=1, active_blocks=7, total_blocks=16384, draining=True),
    ]

    async def publish() -> None:  # as workers do: at least once a second
        while True:
            for report in reports:
                await events.publish(subject(RELEASE, "mock-model", "load"), msgspec.msgpack.encode(report))
            await asyncio.sleep(0.2)

    publisher = asyncio.create_task(publish())
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator.cli.main", "status", "-o", "json", *kube_args(release),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        publisher.cancel()
        await discovery.close()
        await events.close()
    assert proc.returncode == 0, err.decode()
    status = json.loads(out)
    assert status["discovery"] == {"etcd": release.etcd, "nats": release.nats, "namespace": RELEASE,
                                   "source": "ConfigMap weir-ops/ops-weir-config"}  # fmt: skip
    workers = {w["instance_id"]: w for w in status["workers"]}
    assert set(workers) == {"w-a", "w-b"}
    assert workers["w-a"]["pod"] == "ops-weir-pool-main-a"
    assert workers["w-a"]["state"] == "serving"
    assert workers["w-a"]["load"]["active_requests"] == 3
    assert workers["w-a"]["load"]["active_blocks"] == 120
    assert workers["w-b"]["pod"] is None
    assert workers["w-b"]["state"] == "draining"
    assert workers["w-b"]["load"]["active_requests"] == 1


def test_status_reports_unreachable_etcd_but_still_shows_pools(
    capsys: pytest.CaptureFixture[str], release: Release
) -> None:
    result = weir(
        capsys, "status", "-o", "json", "--etcd", f"http://127.0.0.1:{free_port()}", *kube_args(release)
    )
    assert result.rc == 5
    status = json.loads(result.out)
    assert {p["name"] for p in status["pools"]} == {"extra", "main"}
    assert "cannot read discovery from etcd at http://127.0.0.1:" in result.err
    assert "port-forward etcd and pass --etcd" in result.err


async def test_drain_by_pod_name_marks_the_pod_for_scale_down(
    release: Release, core: client.CoreV1Api
) -> None:
    """WORKER may be a pod name; once its worker is gone from discovery the pod gets the lowest
    deletion cost, so the ReplicaSet removes it first on the next scale-down."""
    worker_pod(core, "ops-weir-pool-main-b", "main", "10.9.0.3")
    discovery = make_discovery(release.etcd, RELEASE)
    card = ModelCard(name="mock-model", role="aggregated", backend="mocker")
    await discovery.register(
        Instance(instance_id="w-c", component="worker", address="10.9.0.3:9000", card=card)
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator.cli.main",
        "drain", "ops-weir-pool-main-b", "--drain-timeout", "30",
        *kube_args(release), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while await discovery.get(drain_key("w-c")) is None:
        assert time.monotonic() < deadline, "weir drain never wrote the drain key"
        await asyncio.sleep(0.1)
    await discovery.close()  # the worker stops: its lease and registration go
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert "pod ops-weir-pool-main-b is drained and marked to go first" in out.decode()
    pod = plain(core.read_namespaced_pod("ops-weir-pool-main-b", NS))
    assert pod["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"] == "-1000000"


def test_scale_warns_when_an_autoscaler_owns_the_pool(
    capsys: pytest.CaptureFixture[str], release: Release, tmp_path: Path
) -> None:
    api = config.new_client_from_config(release.kubeconfig, persist_config=False)
    hpa = client.V1HorizontalPodAutoscaler(
        metadata=client.V1ObjectMeta(name="extra-hpa"),
        spec=client.V1HorizontalPodAutoscalerSpec(
            scale_target_ref=client.V1CrossVersionObjectReference(
                api_version="apps/v1", kind="Deployment", name="ops-weir-pool-extra"
            ),
            min_replicas=1,
            max_replicas=4,
        ),
    )
    client.AutoscalingV1Api(api).create_namespaced_horizontal_pod_autoscaler(NS, hpa)
    try:
        # The operator Role may read autoscalers, so operators see the note too.
        operator = str(release.api.write_kubeconfig(tmp_path / "operator", "operator", "operator-token"))
        result = weir(capsys, "scale", "extra", "--replicas", "3", *kube_args(release, operator))
        assert result.rc == 0, result.err
        assert "note: HorizontalPodAutoscaler extra-hpa also sizes this pool (min 1, max 4)" in result.out
        quiet = weir(capsys, "scale", "main", "--replicas", "1", *kube_args(release, operator))
        assert "HorizontalPodAutoscaler" not in quiet.out
    finally:
        client.AutoscalingV1Api(api).delete_namespaced_horizontal_pod_autoscaler("extra-hpa", NS)


def test_helm_upgrade_keeps_the_scaled_size(
    capsys: pytest.CaptureFixture[str], release: Release, apps: client.AppsV1Api, helm_bin: str
) -> None:
    """`weir scale` (or the planner, or an HPA) owns a pool's size after install; an upgrade of
    the release keeps it unless keepScaledReplicas is turned off. Runs last: it resets sizes."""

    def replicas(pool: str) -> int:
        return int(
            plain(apps.read_namespaced_deployment_scale(f"ops-weir-pool-{pool}", NS))["spec"]["replicas"]
        )

    assert weir(capsys, "scale", "extra", "--replicas", "3", *kube_args(release)).rc == 0
    upgrade = helm(helm_bin, "upgrade", *chart_args(release, "--set", "frontend.replicas=2"), check=False)
    assert upgrade.returncode == 0, upgrade.stderr
    assert replicas("extra") == 3
    assert plain(apps.read_namespaced_deployment("ops-weir-frontend", NS))["spec"]["replicas"] == 2

    reset = chart_args(release, "--set", "poolDefaults.keepScaledReplicas=false")
    upgrade = helm(helm_bin, "upgrade", *reset, check=False)
    assert upgrade.returncode == 0, upgrade.stderr
    assert replicas("extra") == 1  # the example's value
