"""What the chart renders: pools become Deployments with the right labels, args and resources;
pods are locked down; etcd and NATS addresses reach every weir pod through one ConfigMap."""

from __future__ import annotations

import pytest

from tests.k8s.helm import CHART, Manifest, find, helm, one, pod_specs, render, template_args

EXAMPLES = CHART / "examples"


@pytest.fixture(scope="module")
def external(helm_bin: str) -> list[Manifest]:
    return render(helm_bin, EXAMPLES / "external-planes.yaml", release="prod", namespace="llm")


@pytest.fixture(scope="module")
def defaults(helm_bin: str) -> list[Manifest]:
    return render(helm_bin)


def _container(workload: Manifest) -> Manifest:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_each_pool_is_a_deployment_with_labels_args_and_gpus(external: list[Manifest]) -> None:
    for pool, role, replicas in [("agg", "aggregated", 4)]:
        dep = one(external, "Deployment", f"prod-weir-pool-{pool}")
        expected = {
            "app.kubernetes.io/name": "weir",
            "app.kubernetes.io/instance": "prod",
            "app.kubernetes.io/component": "worker",
            "weir.dev/pool": pool,
            "weir.dev/role": role,
            "weir.dev/backend": "deepinfer",
        }
        assert expected.items() <= dep["metadata"]["labels"].items()
        assert expected.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        selector = dep["spec"]["selector"]["matchLabels"]
        assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        assert selector["weir.dev/pool"] == pool
        assert dep["spec"]["replicas"] == replicas

        container = _container(dep)
        assert container["args"] == [
            "worker",
            "--backend=deepinfer",
            f"--role={role}",
            "--model=/models/Qwen3-8B",
            "--host=0.0.0.0",
            "--port=9000",
            "--metrics-port=9090",
            "--drain-timeout=285",
        ]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
        pod = dep["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert container["image"] == "ghcr.io/weir-project/weir:0.1.0-cuda"


def test_pool_args_env_and_image_overrides(helm_bin: str) -> None:
    pool = (
        "pools[0].name=mk,pools[0].role=aggregated,pools[0].backend=mocker,pools[0].model=m,"
        "pools[0].replicas=1,pools[0].args[0]=--speedup=5,pools[0].env[0].name=FOO,pools[0].env[0].value=bar,"
        "pools[0].image.tag=cuda,pools[0].terminationGracePeriodSeconds=900"
    )
    manifests = render(helm_bin, sets=dict(kv.split("=", 1) for kv in pool.split(",")))
    dep = one(manifests, "Deployment", "r-weir-pool-mk")
    container = _container(dep)
    assert container["args"][-1] == "--speedup=5"
    assert {"name": "FOO", "value": "bar"} in container["env"]
    assert container["image"] == "ghcr.io/weir-project/weir:cuda"
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 900
    # SIGTERM drains the worker, and the drain must end before the kubelet's SIGKILL.
    assert "--drain-timeout=885" in container["args"]


def test_frontend_deployment_and_service(external: list[Manifest]) -> None:
    dep = one(external, "Deployment", "prod-weir-frontend")
    assert dep["spec"]["replicas"] == 2
    container = _container(dep)
    assert container["args"][:5] == [
        "frontend", "--host=0.0.0.0", "--port=8000", "--probe-port=8081", "--router-mode=kv"
    ]  # fmt: skip
    svc = one(external, "Service", "prod-weir-frontend")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


def test_pods_run_non_root_read_only_without_escalation(helm_bin: str) -> None:
    manifests = render(helm_bin, EXAMPLES / "aggregated-deepinfer.yaml")
    specs = pod_specs(manifests)
    assert {name for name, _ in specs} >= {
        "r-weir-frontend",
        "r-weir-pool-agg",
        "r-weir-etcd",
        "r-weir-nats",
    }
    for name, pod in specs:
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False, name
        for container in pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True, name
            assert ctx["allowPrivilegeEscalation"] is False, name
            assert ctx["capabilities"] == {"drop": ["ALL"]}, name
            assert "privileged" not in ctx, name
            # A read-only root needs somewhere to write: every writer gets a volume.
            mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
            assert mounts, f"{name} has no writable volume"


def test_addresses_reach_pods_through_one_configmap(helm_bin: str) -> None:
    manifests = render(helm_bin, EXAMPLES / "mocker-cpu.yaml", release="prod", namespace="llm")
    configmaps = find(manifests, "ConfigMap")
    assert len(configmaps) == 1
    config = configmaps[0]
    assert config["data"] == {
        "WEIR_ETCD": "http://prod-weir-etcd.llm.svc:2379",
        "WEIR_NATS": "nats://prod-weir-nats.llm.svc:4222",
        "WEIR_NAMESPACE": "prod",
    }
    # The addresses name the bundled Services and their client ports.
    assert one(manifests, "Service", "prod-weir-etcd")["spec"]["ports"][0]["port"] == 2379
    assert one(manifests, "Service", "prod-weir-nats")["spec"]["ports"][0]["port"] == 4222
    weir_pods = find(manifests, "Deployment")
    assert len(weir_pods) == 3  # frontend, main, extra
    for dep in weir_pods:
        container = _container(dep)
        assert container["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}}]
        # Nothing else sets them, so the ConfigMap is the single source.
        assert not {e["name"] for e in container.get("env", [])} & set(config["data"])


def test_external_etcd_and_nats(helm_bin: str) -> None:
    manifests = render(helm_bin, EXAMPLES / "external-planes.yaml")
    assert not find(manifests, "StatefulSet")
    data = find(manifests, "ConfigMap")[0]["data"]
    assert data["WEIR_ETCD"] == "http://etcd.infra.svc:2379"
    assert data["WEIR_NATS"] == "nats://nats.infra.svc:4222"


def test_config_change_rolls_the_pods(helm_bin: str) -> None:
    def checksums(endpoint: str) -> set[str]:
        manifests = render(helm_bin, sets={"etcd.enabled": "false", "etcd.endpoints": endpoint})
        return {
            d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
            for d in find(manifests, "Deployment")
        }

    first, second = checksums("http://a:2379"), checksums("http://b:2379")
    assert len(first) == 1 and len(second) == 1 and first != second


def test_probes_hit_the_health_endpoints(defaults: list[Manifest]) -> None:
    frontend = _container(one(defaults, "Deployment", "r-weir-frontend"))
    assert frontend["readinessProbe"]["httpGet"] == {"path": "/health", "port": "probes"}
    assert frontend["livenessProbe"]["httpGet"] == {"path": "/live", "port": "probes"}
    assert {"name": "probes", "containerPort": 8081, "protocol": "TCP"} in frontend["ports"]
    assert "--probe-port=8081" in frontend["args"]
    worker = _container(one(defaults, "Deployment", "r-weir-pool-agg"))
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports == {"requests": 9000, "metrics": 9090}
    assert worker["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert worker["livenessProbe"]["httpGet"] == {"path": "/live", "port": "metrics"}
    # Model loading may take long: a startup probe holds liveness off for startupSeconds (1800).
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1800


def test_graceful_termination_leaves_time_to_drain(defaults: list[Manifest]) -> None:
    assert (
        one(defaults, "Deployment", "r-weir-pool-agg")["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"
        ]
        == 300
    )
    assert (
        one(defaults, "Deployment", "r-weir-frontend")["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"
        ]
        == 60
    )
    # SIGTERM drains the frontend's streams, and the drain must end before the kubelet's SIGKILL.
    assert "--drain-timeout=45" in _container(one(defaults, "Deployment", "r-weir-frontend"))["args"]


def test_frontend_drain_timeout_follows_its_grace_period(helm_bin: str) -> None:
    manifests = render(helm_bin, sets={"frontend.terminationGracePeriodSeconds": "300"})
    dep = one(manifests, "Deployment", "r-weir-frontend")
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 300
    assert "--drain-timeout=285" in _container(dep)["args"]


def test_frontend_processes_default_to_the_cli_and_can_be_set(
    helm_bin: str, defaults: list[Manifest]
) -> None:
    # Unset, `weir frontend` picks one per usable core (tests/cli/test_frontend_processes.py).
    assert not any(
        a.startswith("--processes")
        for a in _container(one(defaults, "Deployment", "r-weir-frontend"))["args"]
    )
    dep = one(render(helm_bin, sets={"frontend.processes": "3"}), "Deployment", "r-weir-frontend")
    assert "--processes=3" in _container(dep)["args"]


def test_kv_tiers_become_worker_flags_and_a_disk_volume(helm_bin: str) -> None:
    tiers = {"hostGb": "4", "diskGb": "20", "redisUrl": "redis://kv:6379/0"}
    manifests = render(helm_bin, sets={f"poolDefaults.kvTiers.{k}": v for k, v in tiers.items()})
    dep = one(manifests, "Deployment", "r-weir-pool-agg")
    container = _container(dep)
    flags = [
        "--host-cache-gb=4",
        "--disk-cache-dir=/kv-disk",
        "--disk-cache-gb=20",
        "--redis-url=redis://kv:6379/0",
    ]
    assert all(flag in container["args"] for flag in flags), container["args"]
    assert {"name": "kv-disk", "mountPath": "/kv-disk"} in container["volumeMounts"]
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["kv-disk"]["emptyDir"] == {"sizeLimit": "21Gi"}
    # Off by default: no flag, no volume.
    plain = _container(one(render(helm_bin), "Deployment", "r-weir-pool-agg"))
    assert not any(a.startswith(("--host-cache", "--disk-cache", "--redis")) for a in plain["args"])
    assert all(m["name"] != "kv-disk" for m in plain["volumeMounts"])


def test_a_disruption_budget_per_pool_and_frontend(external: list[Manifest]) -> None:
    budgets = {p["metadata"]["name"]: p for p in find(external, "PodDisruptionBudget")}
    assert set(budgets) == {"prod-weir-frontend", "prod-weir-pool-agg"}
    for name, budget in budgets.items():
        assert budget["apiVersion"] == "policy/v1"
        assert budget["spec"]["maxUnavailable"] == 1
        dep = one(external, "Deployment", name)
        assert budget["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_no_budgets_when_disabled(helm_bin: str) -> None:
    assert not find(render(helm_bin, sets={"podDisruptionBudget.enabled": "false"}), "PodDisruptionBudget")


def test_service_monitor_when_enabled(external: list[Manifest], defaults: list[Manifest]) -> None:
    assert not find(defaults, "ServiceMonitor")
    monitors = {m["metadata"]["name"]: m for m in find(external, "ServiceMonitor")}
    assert set(monitors) == {"prod-weir-frontend", "prod-weir-worker"}
    services = find(external, "Service")
    for monitor in monitors.values():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        selector = monitor["spec"]["selector"]["matchLabels"]
        matched = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
        assert len(matched) == 1, monitor["metadata"]["name"]
        port_names = {p["name"] for p in matched[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in port_names
            assert endpoint["path"] == "/metrics"


def test_network_policy_option(helm_bin: str, defaults: list[Manifest]) -> None:
    assert not find(defaults, "NetworkPolicy")
    manifests = render(helm_bin, EXAMPLES / "external-planes.yaml")
    policies = {p["metadata"]["name"]: p["spec"] for p in find(manifests, "NetworkPolicy")}
    assert set(policies) == {"r-weir-internal", "r-weir-workers", "r-weir-api", "r-weir-metrics"}
    release = {"app.kubernetes.io/name": "weir", "app.kubernetes.io/instance": "r"}
    internal = policies["r-weir-internal"]
    assert internal["ingress"] == [{"from": [{"podSelector": {"matchLabels": release}}]}]
    not_workers = {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["worker"]}
    assert internal["podSelector"]["matchExpressions"] == [not_workers]
    # Workers' request plane: only from the frontend and the router.
    workers = policies["r-weir-workers"]
    assert workers["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    [rule] = workers["ingress"]
    assert rule["ports"] == [{"port": "requests", "protocol": "TCP"}]
    callers = {"key": "app.kubernetes.io/component", "operator": "In", "values": ["frontend", "router"]}
    assert rule["from"] == [{"podSelector": {"matchLabels": release, "matchExpressions": [callers]}}]
    api = policies["r-weir-api"]
    assert api["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "frontend"
    assert api["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    ]
    assert api["ingress"][0]["ports"] == [{"port": "http", "protocol": "TCP"}]


def test_api_key_secret(helm_bin: str) -> None:
    created = render(helm_bin, sets={"frontend.apiKey.value": "s3cret"})
    secret = one(created, "Secret", "r-weir-api-key")
    env = _container(one(created, "Deployment", "r-weir-frontend"))["env"]
    key_env = next(e for e in env if e["name"] == "WEIR_API_KEY")
    assert key_env["valueFrom"]["secretKeyRef"] == {"name": "r-weir-api-key", "key": "api-key"}
    assert "api-key" in secret["data"]

    existing = render(helm_bin, EXAMPLES / "external-planes.yaml")
    assert not find(existing, "Secret")
    env = _container(one(existing, "Deployment", "r-weir-frontend"))["env"]
    key_env = next(e for e in env if e["name"] == "WEIR_API_KEY")
    assert key_env["valueFrom"]["secretKeyRef"] == {"name": "weir-api-key", "key": "api-key"}


def test_cluster_secret_reaches_frontend_router_and_workers(helm_bin: str) -> None:
    assert not any(
        e["name"] == "WEIR_CLUSTER_SECRET"
        for e in _container(one(render(helm_bin), "Deployment", "r-weir-frontend")).get("env", [])
    )
    for sets, name in (
        (
            {"clusterSecret.value": "0123456789abcdef-secret", "router.enabled": "true"},
            "r-weir-cluster-secret",
        ),
        ({"clusterSecret.existingSecret": "mine", "router.enabled": "true"}, "mine"),
    ):
        manifests = render(helm_bin, sets=sets)
        created = [s for s in find(manifests, "Secret") if s["metadata"]["name"] == "r-weir-cluster-secret"]
        assert bool(created) == ("clusterSecret.value" in sets)
        deployments = find(manifests, "Deployment")
        components = {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in deployments}
        assert {"frontend", "router", "worker"} <= components
        for deployment in deployments:
            env = {e["name"]: e for e in _container(deployment)["env"]}
            ref = env["WEIR_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": name, "key": "cluster-secret"}, deployment["metadata"]["name"]


TLS_DIR = "/etc/weir/request-plane-tls"


def test_request_plane_tls_mounts_the_secret_and_passes_the_flags(helm_bin: str) -> None:
    """Workers serve (cert, key), the router serves and dials (cert, key, CA), the frontend only
    dials and sees ca.crt alone; the Secret is mounted read-only. Off by default: no trace."""
    for manifests in (render(helm_bin, sets={"router.enabled": "true"}), render(helm_bin)):
        for deployment in find(manifests, "Deployment"):
            pod = deployment["spec"]["template"]["spec"]
            container = _container(deployment)
            assert not [a for a in container["args"] if a.startswith("--tls-")]
            assert not [v for v in pod["volumes"] if v["name"] == "request-plane-tls"]
            assert not [m for m in container["volumeMounts"] if m["name"] == "request-plane-tls"]
            assert not [e for e in container.get("env", []) if e["name"].startswith("WEIR_TLS")]

    sets = {
        "router.enabled": "true",
        "requestPlaneTLS.enabled": "true",
        "requestPlaneTLS.secretName": "weir-tls",
    }
    manifests = render(helm_bin, EXAMPLES / "mocker-cpu.yaml", sets=sets)
    serve = [f"--tls-cert={TLS_DIR}/tls.crt", f"--tls-key={TLS_DIR}/tls.key"]
    dial = [f"--tls-ca={TLS_DIR}/ca.crt"]
    expected = {"worker": (serve, None), "router": (serve + dial, None), "frontend": (dial, ["ca.crt"])}
    seen = []
    for deployment in find(manifests, "Deployment"):
        component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        flags, items = expected[component]
        seen.append(component)
        container = _container(deployment)
        assert [a for a in container["args"] if a.startswith("--tls-")] == flags, deployment["metadata"][
            "name"
        ]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "request-plane-tls"]
        assert mount == {"name": "request-plane-tls", "mountPath": TLS_DIR, "readOnly": True}
        (volume,) = [
            v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
        ]
        assert volume["secret"]["secretName"] == "weir-tls"
        assert [i["key"] for i in volume["secret"].get("items", [])] == (items or [])
    assert sorted(seen) == ["frontend", "router", "worker", "worker"]
    # The chart only names the Secret (cert-manager or the user makes it).
    assert not [s for s in find(manifests, "Secret") if s["metadata"]["name"] == "weir-tls"]


def test_request_plane_tls_needs_a_secret_name(helm_bin: str) -> None:
    for sets in (
        {"requestPlaneTLS.enabled": "true"},
        {"requestPlaneTLS.enabled": "true", "requestPlaneTLS.secretName": ""},
    ):
        result = helm(helm_bin, *template_args(sets=sets), check=False)
        assert result.returncode != 0, sets
        assert "requestPlaneTLS" in result.stderr and "secretName" in result.stderr, result.stderr
    # A name without enabled is fine (it is simply not used).
    assert render(helm_bin, sets={"requestPlaneTLS.secretName": "weir-tls"})


def test_operator_role_grants_what_the_cli_uses(helm_bin: str) -> None:
    manifests = render(
        helm_bin,
        sets={
            "operatorRole.subjects[0].kind": "User",
            "operatorRole.subjects[0].name": "alice",
            "operatorRole.subjects[0].apiGroup": "rbac.authorization.k8s.io",
        },
    )
    rules = one(manifests, "Role", "r-weir-operator")["rules"]
    granted = {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert {
        ("apps", "deployments", "list"),
        ("apps", "deployments/scale", "patch"),
        ("", "configmaps", "list"),
        ("", "pods", "list"),
    } <= granted
    binding = one(manifests, "RoleBinding", "r-weir-operator")
    assert binding["subjects"] == [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}]


def test_frontend_sees_model_directories_where_workers_do(external: list[Manifest]) -> None:
    """The frontend loads tokenizers from the directory a worker's card names, so both mount
    the same claim at the same path and agree on the cache variables."""
    frontend = one(external, "Deployment", "prod-weir-frontend")
    views = []
    for dep in [frontend, one(external, "Deployment", "prod-weir-pool-agg")]:
        pod = dep["spec"]["template"]["spec"]
        claim = next(v for v in pod["volumes"] if v["name"] == "cache")["persistentVolumeClaim"]["claimName"]
        container = _container(dep)
        mount = next(m for m in container["volumeMounts"] if m["name"] == "cache")["mountPath"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        views.append((claim, mount, env["WEIR_CACHE_DIR"], env["HF_HOME"]))
    assert views[0] == views[1] == ("weir-models", "/models", "/models/weir", "/models/hf")


def test_standalone_router_option(helm_bin: str, defaults: list[Manifest]) -> None:
    assert not [m for m in defaults if m["metadata"]["name"] == "r-weir-router"]
    manifests = render(helm_bin, sets={"router.enabled": "true", "serviceMonitor.enabled": "true"})
    router = one(manifests, "Deployment", "r-weir-router")
    container = _container(router)
    assert container["args"] == [
        "router",
        "--host=0.0.0.0",
        "--port=9100",
        "--metrics-port=9101",
        "--router-mode=kv",
    ]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "metrics"}
    advertise = {e["name"]: e for e in container["env"]}["WEIR_ADVERTISE_HOST"]
    assert advertise["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    svc = one(manifests, "Service", "r-weir-router")
    assert svc["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"requests": 9100, "metrics": 9101}
    # The frontends ask the router through its Service.
    frontend = _container(one(manifests, "Deployment", "r-weir-frontend"))
    assert frontend["args"][4:6] == ["--router-mode=remote", "--router-address=r-weir-router.weir.svc:9100"]
    monitor = one(manifests, "ServiceMonitor", "r-weir-router")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
