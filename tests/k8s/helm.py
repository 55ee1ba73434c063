"""Rendering the chart with the real `helm` binary (see .ci/helm.sh)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "weir"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
BAD_VALUES = sorted((Path(__file__).parent / "bad_values").glob("*.yaml"))

Manifest = dict[str, Any]


def helm_binary() -> str | None:
    for candidate in (os.environ.get("WEIR_HELM"), str(ROOT / ".helm-bin" / "helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def helm(binary: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, check=check)


def template_args(
    *values: Path | str, sets: dict[str, str] | None = None, release: str = "r", namespace: str = "weir"
) -> list[str]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    for path in values:
        args += ["-f", str(path)]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    return args


def render(
    binary: str,
    *values: Path | str,
    sets: dict[str, str] | None = None,
    release: str = "r",
    namespace: str = "weir",
) -> list[Manifest]:
    out = helm(binary, *template_args(*values, sets=sets, release=release, namespace=namespace)).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(manifests: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)]


def one(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    found = find(manifests, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_specs(manifests: list[Manifest]) -> list[tuple[str, Manifest]]:
    """(workload name, pod spec) for every Deployment and StatefulSet."""
    return [
        (m["metadata"]["name"], m["spec"]["template"]["spec"])
        for m in manifests
        if m["kind"] in ("Deployment", "StatefulSet")
    ]
