"""`weir status` on a machine without Kubernetes: discovery is what there is to show.

Real etcd with a registered worker, `weir status` as a subprocess; Kubernetes is either not
configured at all, skipped with --no-kubernetes, or a kubeconfig naming a server that is not
there (still an error). tests/k8s/test_operator.py covers status against a real apiserver."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.runtime.discovery import make_discovery
from orchestrator.runtime.protocol import Instance, ModelCard
from tests.cli.procs import REPO
from tests.servers import free_port

WEIR_NS = "status-test"


@dataclass(frozen=True)
class Result:
    rc: int
    out: str
    err: str


@pytest.fixture
async def worker(etcd_url: str) -> AsyncIterator[str]:
    """A worker registered in discovery, as `weir worker` would be; its instance id."""
    discovery = make_discovery(etcd_url, WEIR_NS)
    card = ModelCard(
        name="mock-model", backend="mocker", total_kv_blocks=16384, kv_tiers={"host": 65536, "remote": 0}
    )
    await discovery.register(
        Instance(instance_id="w-1", component="worker", address="10.0.0.7:9000", card=card)
    )
    yield "w-1"
    await discovery.close()


@pytest.fixture
def no_kubernetes_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a laptop that never had a cluster: no kubeconfig, not in a pod."""
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    return env | {"KUBECONFIG": str(tmp_path / "no-kubeconfig"), "HOME": str(tmp_path)}


def dead_kubeconfig(tmp_path: Path) -> Path:
    """A kubeconfig whose API server does not answer."""
    path = tmp_path / "dead-kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{free_port()}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


async def status(env: dict[str, str], *args: str) -> Result:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator.cli.main", "status", "--load-window", "0", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO, env=env,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


async def test_without_kubernetes_it_shows_discovery_and_succeeds(
    worker: str, etcd_url: str, no_kubernetes_env: dict[str, str]
) -> None:
    planes = ("--etcd", etcd_url, "--weir-namespace", WEIR_NS)
    table = await status(no_kubernetes_env, *planes)
    assert (table.rc, table.err) == (0, "")
    lines = table.out.splitlines()
    assert lines[0] == "Pools: not shown, Kubernetes not configured (no kubeconfig, not in a pod)"
    assert any(line.startswith(worker) and "10.0.0.7:9000" in line for line in lines)
    assert any(line.startswith(worker) and line.endswith("host:65536,remote") for line in lines), lines
    assert lines[-1] == "By role: aggregated 1"
    listed = await status(no_kubernetes_env, *planes, "-o", "json")
    assert listed.rc == 0
    report = json.loads(listed.out)
    assert [w["instance_id"] for w in report["workers"]] == [worker]
    assert report["workers"][0]["kv_tiers"] == {"host": 65536, "remote": 0}
    assert report["roles"] == {"aggregated": 1}
    assert (report["pools"], report["errors"]) == ([], [])
    assert report["kubernetes_skipped"] == "not configured (no kubeconfig, not in a pod)"


async def test_no_kubernetes_skips_even_a_configured_cluster(
    worker: str, etcd_url: str, no_kubernetes_env: dict[str, str], tmp_path: Path
) -> None:
    env = no_kubernetes_env | {"KUBECONFIG": str(dead_kubeconfig(tmp_path))}
    result = await status(
        env, "--etcd", etcd_url, "--weir-namespace", WEIR_NS, "--no-kubernetes", "-o", "json"
    )
    assert (result.rc, result.err) == (0, "")  # the dead server was never asked
    report = json.loads(result.out)
    assert report["kubernetes_skipped"] == "skipped (--no-kubernetes)"
    assert [w["instance_id"] for w in report["workers"]] == [worker]


async def test_a_kubeconfig_that_does_not_work_is_still_an_error(
    worker: str, etcd_url: str, no_kubernetes_env: dict[str, str], tmp_path: Path
) -> None:
    env = no_kubernetes_env | {"KUBECONFIG": str(dead_kubeconfig(tmp_path))}
    result = await status(env, "--etcd", etcd_url, "--weir-namespace", WEIR_NS, "-o", "json")
    assert result.rc == 5
    assert "unreachable" in result.err
    report = json.loads(result.out)
    assert report["kubernetes_skipped"] is None
    assert [w["instance_id"] for w in report["workers"]] == [worker]  # discovery is shown all the same


async def test_without_kubernetes_or_etcd_there_is_nothing_to_read(no_kubernetes_env: dict[str, str]) -> None:
    result = await status(no_kubernetes_env)
    assert result.rc == 5
    assert "Kubernetes not configured (no kubeconfig, not in a pod): pass --etcd URL" in result.err
    both = await status(no_kubernetes_env, "--no-kubernetes", "--no-discovery")
    assert both.rc == 2 and "nothing to show" in both.err
