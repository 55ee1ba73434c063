"""What the chart renders for disaggregated serving: each pool's role reaches `weir worker
--role` and its labels, `frontend.disaggregation` reaches `weir frontend --disaggregation`, and a
decode pool can reach the prefill workers it pulls KV from (NetworkPolicy, request-plane TLS).
test_chart_processes runs disaggregated-mocker.yaml and checks that a request is handed over."""

from __future__ import annotations

import pytest

from orchestrator.cli.main import build_parser
from tests.k8s.helm import CHART, Manifest, one, render

EXAMPLE = CHART / "examples" / "disaggregated-mocker.yaml"
TLS_CA = "--tls-ca=/etc/weir/request-plane-tls/ca.crt"


def _args(manifests: list[Manifest], deployment: str) -> list[str]:
    (container,) = one(manifests, "Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return list(container["args"])


@pytest.fixture(scope="module")
def disaggregated(helm_bin: str) -> list[Manifest]:
    sets = {"networkPolicy.enabled": "true", "requestPlaneTLS.enabled": "true",
            "requestPlaneTLS.secretName": "weir-tls"}  # fmt: skip
    return render(helm_bin, EXAMPLE, sets=sets)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_pool_role_reaches_the_worker_and_its_labels(disaggregated: list[Manifest], role: str) -> None:
    dep = one(disaggregated, "Deployment", f"r-weir-pool-{role}")
    assert dep["metadata"]["labels"]["weir.dev/role"] == role
    assert dep["spec"]["template"]["metadata"]["labels"]["weir.dev/role"] == role
    args = build_parser(only="worker").parse_args(_args(disaggregated, f"r-weir-pool-{role}"))
    assert (args.role, args.backend, args.model) == (role, "mocker", "smollm2-135m-instruct")


def test_disaggregation_reaches_the_frontend(helm_bin: str, disaggregated: list[Manifest]) -> None:
    parse = build_parser(only="frontend").parse_args
    assert parse(_args(disaggregated, "r-weir-frontend")).disaggregation == "always"
    # The default is the frontend's own, with or without the standalone router.
    for sets in ({}, {"router.enabled": "true"}):
        assert parse(_args(render(helm_bin, sets=sets), "r-weir-frontend")).disaggregation == "adaptive"


def test_decode_workers_dial_prefill_workers(disaggregated: list[Manifest]) -> None:
    """A decode worker pulls the prompt's KV from a prefill worker's request-plane port: it
    trusts the request plane's CA, and the workers' NetworkPolicy admits decode workers (only
    frontends and routers without a decode pool: test_chart_manifests)."""
    assert TLS_CA in _args(disaggregated, "r-weir-pool-decode")
    assert TLS_CA not in _args(disaggregated, "r-weir-pool-prefill")
    [rule] = one(disaggregated, "NetworkPolicy", "r-weir-workers")["spec"]["ingress"]
    release = {"app.kubernetes.io/name": "weir", "app.kubernetes.io/instance": "r"}
    decode = release | {"app.kubernetes.io/component": "worker", "weir.dev/role": "decode"}
    assert {"podSelector": {"matchLabels": decode}} in rule["from"]
