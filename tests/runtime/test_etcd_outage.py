"""etcd going away and coming back: watchers keep the last known workers, leases are restored."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from orchestrator.runtime.discovery import Discovery, DiscoveryEvent, DiscoveryUnavailable, make_discovery
from orchestrator.runtime.protocol import Instance
from tests.servers import find_binary, free_port, wait_for_port


class RestartableEtcd:
    """An etcd of this test's own, on fixed ports, that can be stopped and started again."""

    def __init__(self, workdir: Path) -> None:
        binary = find_binary("etcd", "/usr/bin/etcd")
        assert binary is not None
        self.data_dir = workdir / "data"
        self.client, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client}"
        self.args = [
            binary,
            "--name=default",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            "--log-level=error",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.client, proc=self.proc)

    def stop(self, wipe: bool = False) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        if wipe:
            shutil.rmtree(self.data_dir)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[RestartableEtcd]:
    server = RestartableEtcd(tmp_path)
    server.start()
    yield server
    if server.proc is not None:
        server.stop()


async def until(
    events: list[DiscoveryEvent], predicate: Callable[[list[DiscoveryEvent]], bool], timeout: float
) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate(events):
        if asyncio.get_running_loop().time() > deadline:
            seen = [(e.kind, e.instance.instance_id) for e in events]
            raise TimeoutError(f"condition not met; events: {seen}")
        await asyncio.sleep(0.05)


async def eventually_listed(discovery: Discovery, ids: list[str], timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        with contextlib.suppress(DiscoveryUnavailable):
            if sorted(i.instance_id for i in await discovery.list("worker")) == ids:
                return True
        await asyncio.sleep(0.1)
    return False


@contextlib.asynccontextmanager
async def watched(
    etcd: RestartableEtcd, namespace: str
) -> AsyncIterator[tuple[Discovery, Discovery, list[DiscoveryEvent]]]:
    """A worker's discovery and a frontend's, the frontend watching workers: (worker side,
    frontend side, the events it saw so far)."""
    worker_side = make_discovery(etcd.url, namespace, ttl=2)
    frontend_side = make_discovery(etcd.url, namespace, ttl=2)
    events: list[DiscoveryEvent] = []

    async def watch() -> None:
        async for event in frontend_side.watch("worker"):
            events.append(event)

    watcher = asyncio.create_task(watch())
    try:
        yield worker_side, frontend_side, events
    finally:
        watcher.cancel()
        await worker_side.close()
        await frontend_side.close()


@pytest.mark.slow
async def test_outage_keeps_known_workers_and_restores_registrations(etcd: RestartableEtcd) -> None:
    async with watched(etcd, "outage") as (worker_side, frontend_side, events):
        await worker_side.register(Instance(instance_id="w1", component="worker", address="127.0.0.1:7"))
        await until(events, lambda e: len(e) == 1, 10)

        # etcd dies and comes back empty (lost its data): longer than the lease TTL.
        etcd.stop(wipe=True)
        await asyncio.sleep(3)
        assert [e.kind for e in events] == ["put"], "nothing is dropped while etcd is unreachable"
        etcd.start()

        # The worker's keep-alive finds its lease gone and registers again. (If the watcher
        # relists the empty store first, it reports w1 deleted and then put back.)
        assert await eventually_listed(frontend_side, ["w1"], 15)
        assert events[-1].kind == "put"

        # And the watch is live again for new changes.
        await worker_side.register(Instance(instance_id="w2", component="worker", address="127.0.0.1:8"))
        await until(events, lambda e: e[-1].instance.instance_id == "w2", 10)


@pytest.mark.slow
async def test_short_outage_with_data_kept_loses_nothing(etcd: RestartableEtcd) -> None:
    async with watched(etcd, "blip") as (worker_side, frontend_side, events):
        await worker_side.register(Instance(instance_id="w1", component="worker"))
        await until(events, lambda e: len(e) == 1, 10)
        etcd.stop()
        await asyncio.sleep(1)  # an outage shorter than the lease TTL
        etcd.start()
        restarted = asyncio.get_running_loop().time()
        # Right after the restart the client may not have reconnected yet: the registration
        # is then reported as failed but still written once etcd answers (and w1 written
        # again, unchanged, which is no change to report).
        with contextlib.suppress(DiscoveryUnavailable):
            await worker_side.register(Instance(instance_id="w2", component="worker"))
        await until(events, lambda e: e[-1].instance.instance_id == "w2", 15)
        # What is tested is time itself: the keys must outlive a TTL after the restart, which
        # only keep-alives flowing again allow (a lost lease would show as a delete and a put).
        ttl_later = restarted + worker_side.ttl * 1.5
        await asyncio.sleep(max(0.0, ttl_later - asyncio.get_running_loop().time()))
        assert sorted(i.instance_id for i in await frontend_side.list("worker")) == ["w1", "w2"]
        assert [(e.kind, e.instance.instance_id) for e in events] == [("put", "w1"), ("put", "w2")]
