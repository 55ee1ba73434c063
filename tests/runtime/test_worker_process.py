"""A worker process (WorkerHost under serve_workers) on real etcd: SIGTERM drains, then exits."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx

from orchestrator.runtime.discovery import make_discovery
from orchestrator.runtime.protocol import WorkerRequest
from orchestrator.runtime.request_plane import RequestPlaneClient, TcpWorkerClient
from tests.servers import free_port

REPO = Path(__file__).resolve().parents[2]

WORKER = """
import asyncio, sys
from orchestrator.runtime.discovery import make_discovery
from orchestrator.runtime.events import make_event_plane
from orchestrator.runtime.worker_host import WorkerHost, serve_workers
from tests.runtime.fake_engine import FakeEngine

async def main():
    etcd, namespace, metrics_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    discovery = make_discovery(etcd, namespace, ttl=2)
    events = make_event_plane(None)
    host = WorkerHost(FakeEngine(step_s=0.02), discovery, events, namespace, instance_id="sig")
    await serve_workers([host], metrics_port=metrics_port, metrics_host="127.0.0.1")
    await discovery.close()

asyncio.run(main())
"""


async def test_sigterm_finishes_in_flight_requests_then_exits(etcd_url: str) -> None:
    namespace = f"sig{uuid.uuid4().hex[:6]}"
    metrics_port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", WORKER, etcd_url, namespace, str(metrics_port)], cwd=REPO)
    observer = make_discovery(etcd_url, namespace)
    client = RequestPlaneClient()
    try:
        watch = observer.watch("worker")
        instance = (await asyncio.wait_for(anext(watch), 30)).instance
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{metrics_port}") as http:
            assert (await http.get("/health")).status_code == 200

        stream = TcpWorkerClient(client, instance.address).generate(
            WorkerRequest(request_id="r", token_ids=[1, 2], max_tokens=40)
        )
        deltas = [await anext(stream)]
        os.kill(proc.pid, signal.SIGTERM)
        deltas += [delta async for delta in stream]
        assert len(deltas) == 40 and deltas[-1].finish_reason == "length"

        assert await asyncio.wait_for(asyncio.to_thread(proc.wait), 10) == 0
        assert await observer.list("worker") == []
    finally:
        proc.kill()
        proc.wait()
        await client.close()
        await observer.close()
