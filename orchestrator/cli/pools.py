"""Worker pools as the chart creates them: one Deployment per pool, found by its labels."""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes import client

from orchestrator.cli.kube import EXIT_NOT_FOUND, EXIT_USAGE, OperatorError, api_errors, meta

# Labels set by helm/weir (templates/_helpers.tpl); they are the contract between chart and CLI.
NAME_LABEL = "app.kubernetes.io/name"
RELEASE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
POOL_LABEL = "weir.dev/pool"
ROLE_LABEL = "weir.dev/role"
BACKEND_LABEL = "weir.dev/backend"


@dataclass(frozen=True, slots=True)
class Pool:
    name: str
    release: str
    namespace: str
    deployment: str
    role: str
    backend: str
    desired: int
    ready: int

    @classmethod
    def from_deployment(cls, dep: client.V1Deployment) -> Pool:
        labels = meta(dep).labels or {}
        return cls(
            name=labels.get(POOL_LABEL, ""),
            release=labels.get(RELEASE_LABEL, ""),
            namespace=str(meta(dep).namespace),
            deployment=str(meta(dep).name),
            role=labels.get(ROLE_LABEL, "?"),
            backend=labels.get(BACKEND_LABEL, "?"),
            desired=dep.spec.replicas if dep.spec.replicas is not None else 1,
            # Without a controller nothing fills status; absent means none ready.
            ready=(dep.status.ready_replicas if dep.status else None) or 0,
        )


def selector(release: str | None, pool: str | None = None) -> str:
    terms = [f"{NAME_LABEL}=weir", f"{COMPONENT_LABEL}=worker"]
    if release:
        terms.append(f"{RELEASE_LABEL}={release}")
    if pool:
        terms.append(f"{POOL_LABEL}={pool}")
    return ",".join(terms)


def list_pools(api: client.ApiClient, namespace: str, release: str | None) -> list[Pool]:
    apps = client.AppsV1Api(api)
    with api_errors(api, f"list Deployments in namespace {namespace}"):
        found = apps.list_namespaced_deployment(namespace, label_selector=selector(release))
    pools = [Pool.from_deployment(dep) for dep in found.items]
    return sorted(pools, key=lambda p: (p.release, p.name))


def find_pool(api: client.ApiClient, namespace: str, release: str | None, name: str) -> Pool:
    """The one pool called `name`; a clear error when there is none or the release is ambiguous."""
    pools = list_pools(api, namespace, release)
    matches = [p for p in pools if p.name == name]
    where = f"namespace {namespace}" + (f", release {release}" if release else "")
    if not matches:
        known = ", ".join(sorted({f"{p.name} ({p.role})" for p in pools})) or "none"
        raise OperatorError(f"no pool named {name!r} in {where} (pools there: {known})", EXIT_NOT_FOUND)
    if len(matches) > 1:
        releases = ", ".join(p.release for p in matches)
        raise OperatorError(
            f"pool {name!r} exists in several releases in {where} ({releases}): choose one with --release",
            EXIT_USAGE,
        )
    return matches[0]
