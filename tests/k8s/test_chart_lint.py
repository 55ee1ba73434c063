"""The chart as a whole: lint, every example renders, bad values are refused, and every
rendered manifest is valid Kubernetes (strict schemas, 1.29 and the newest known)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.k8s.helm import BAD_VALUES, CHART, EXAMPLES, Manifest, helm, render, template_args

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
# Kinds from CRDs have no schema in kubernetes-validate; test_chart_manifests checks their shape.
CRD_KINDS = {"ServiceMonitor"}
# Every optional feature at once, so validation covers templates the examples leave off.
ALL_FEATURES = {
    "serviceMonitor.enabled": "true",
    "networkPolicy.enabled": "true",
    "router.enabled": "true",
    "frontend.apiKey.value": "secret",
    "requestPlaneTLS.enabled": "true",
    "requestPlaneTLS.secretName": "weir-tls",
    "etcd.persistence.enabled": "true",
    "poolDefaults.kvTiers.hostGb": "4",
    "poolDefaults.kvTiers.diskGb": "20",
    "poolDefaults.kvTiers.redisUrl": "redis://kv:6379/0",
    "operatorRole.subjects[0].kind": "User",
    "operatorRole.subjects[0].name": "alice",
    "operatorRole.subjects[0].apiGroup": "rbac.authorization.k8s.io",
}


def _expected_error(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} must start with '# expect: <error text>'"
    return first.removeprefix("# expect: ")


def test_lint_strict(helm_bin: str) -> None:
    result = helm(helm_bin, "lint", "--strict", str(CHART), check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_lint_strict_with_example(helm_bin: str, example: Path) -> None:
    result = helm(helm_bin, "lint", "--strict", str(CHART), "-f", str(example), check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("bad", BAD_VALUES, ids=lambda p: p.name)
def test_bad_values_are_refused(helm_bin: str, bad: Path) -> None:
    result = helm(helm_bin, *template_args(bad), check=False)
    assert result.returncode != 0, f"{bad.name} rendered although it is invalid"
    assert _expected_error(bad) in result.stderr, result.stderr


def _validate_all(manifests: list[Manifest]) -> list[str]:
    checked = []
    for manifest in manifests:
        if manifest["kind"] in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(manifest, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(
                    f"{manifest['kind']}/{manifest['metadata']['name']} invalid for {version}: "
                    f"{exc.message} at {list(exc.path)}"
                )
        checked.append(manifest["kind"])
    return checked


@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=lambda p: p.name if p else "defaults")
def test_rendered_manifests_are_valid_kubernetes(helm_bin: str, values: Path | None) -> None:
    manifests = render(helm_bin, *([values] if values else []))
    checked = _validate_all(manifests)
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= set(checked)


def test_every_feature_is_valid_kubernetes(helm_bin: str) -> None:
    manifests = render(helm_bin, sets=ALL_FEATURES)
    checked = set(_validate_all(manifests))
    assert {"NetworkPolicy", "Secret", "Role", "RoleBinding", "StatefulSet"} <= checked
    assert any(m["kind"] == "ServiceMonitor" for m in manifests)


def test_validator_catches_a_broken_manifest(helm_bin: str) -> None:
    """The validation above is only worth something if it fails on a wrong manifest."""
    deployment = next(m for m in render(helm_bin) if m["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # typo of "resources"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def test_the_schemas_router_modes_are_the_commands_choices() -> None:
    """A mode the chart offers is one its command serves, and every one they serve is offered."""
    import json

    from orchestrator.frontend.config import ROUTER_MODES
    from router.router import MODES

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    # `remote` is the chart's router.enabled, not a frontend routerMode.
    assert schema["frontend"]["properties"]["routerMode"]["enum"] == [
        m for m in ROUTER_MODES if m != "remote"
    ]
    assert schema["router"]["properties"]["routerMode"]["enum"] == list(MODES)
