"""A closed request plane under abuse: a real `weir worker --backend mocker` (cluster secret
from WEIR_CLUSTER_SECRET) while another thread sends it a 64 MiB frame header after a valid
handshake, garbage without one, and floods of connections. The worker keeps its lease (still
in etcd after more than two TTLs), a concurrent normal request's time to first token stays
within 2x of its baseline, its RSS grows under 50 MB; an unauthenticated `generate` is
refused while a frontend holding the secret serves; another request's block hashes never buy
its cache. Prints one JSON line of figures."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import statistics
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from orchestrator.runtime.discovery import make_discovery
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import Instance, WorkerRequest
from orchestrator.runtime.request_plane import PlaneSecurity, RequestPlaneClient, TcpWorkerClient
from orchestrator.runtime.request_plane.security import NONCE_BYTES, caller_proof
from tests.cluster import LEASE_TTL, planes, start_frontend, start_workers

pytestmark = pytest.mark.slow

SECRET = "chaos-cluster-secret-0123456789"
PROMPT = list(range(1000, 1256))


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class Attacker(threading.Thread):
    """Blocking sockets in a thread of its own, so the abuse never waits on the loop that
    measures the honest requests."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(daemon=True)
        self.where = (host, port)
        self.stop = threading.Event()
        self.counts = {"big_frames": 0, "garbage": 0, "floods": 0, "refused_in_flood": 0}

    def run(self) -> None:
        while not self.stop.is_set():
            self.big_frame()
            self.garbage()
            self.flood(100)

    def _send_until_closed(self, sock: socket.socket, chunk: bytes, limit: int) -> None:
        with contextlib.suppress(OSError):
            for _ in range(limit // len(chunk)):
                sock.sendall(chunk)

    def big_frame(self) -> None:
        """A 64 MiB length prefix after a valid handshake (a peer that has the secret)."""
        with socket.create_connection(self.where, timeout=10) as sock:
            nonce = _recv_exactly(sock, NONCE_BYTES)
            sock.sendall(caller_proof(SECRET.encode(), nonce) + bytes(NONCE_BYTES))
            _recv_exactly(sock, 32)
            sock.sendall((64 * 1024 * 1024).to_bytes(4, "big"))
            self._send_until_closed(sock, bytes(1 << 20), 64 << 20)
        self.counts["big_frames"] += 1

    def garbage(self) -> None:
        """Random bytes without a handshake."""
        with socket.create_connection(self.where, timeout=10) as sock:
            self._send_until_closed(sock, bytes(range(256)) * 256, 16 << 20)
        self.counts["garbage"] += 1

    def flood(self, n: int) -> None:
        socks = []
        try:
            for _ in range(n):
                with contextlib.suppress(OSError):
                    socks.append(socket.create_connection(self.where, timeout=10))
            for sock in socks:  # beyond the per-peer cap the worker closes at once
                sock.settimeout(0.5)
                with contextlib.suppress(OSError):
                    if sock.recv(64, socket.MSG_PEEK) == b"":
                        self.counts["refused_in_flood"] += 1
        finally:
            for sock in socks:
                sock.close()
        self.counts["floods"] += 1


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


async def ttft(worker: TcpWorkerClient, request_id: str) -> float:
    start = time.perf_counter()
    stream = worker.generate(WorkerRequest(request_id=request_id, token_ids=PROMPT, max_tokens=4))
    try:
        await anext(stream)
        return time.perf_counter() - start
    finally:
        await stream.aclose()


async def measure(worker: TcpWorkerClient, tag: str, n: int) -> list[float]:
    return [await ttft(worker, f"{tag}-{i}") for i in range(n)]


async def listed(etcd_url: str, namespace: str) -> list[Instance]:
    discovery = make_discovery(etcd_url, namespace)
    try:
        return await discovery.list("worker")
    finally:
        await discovery.close()


def test_a_closed_request_plane_survives_abuse(
    etcd_url: str, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIR_CLUSTER_SECRET", SECRET)  # every weir process started below
    plane_args = planes(etcd_url, nats_url, "abuse")
    namespace = plane_args[plane_args.index("--weir-namespace") + 1]
    with ExitStack() as stack:
        procs, _ = start_workers(stack, plane_args, tmp_path, ("w",), speedup=1)
        frontend, _ = start_frontend(stack, plane_args, tmp_path, 1)
        [instance] = asyncio.run(listed(etcd_url, namespace))
        host, _, port = instance.address.rpartition(":")
        pid = procs["w"].pid
        figures = asyncio.run(_abuse(instance.address, host, int(port), pid, etcd_url, namespace))

        # The frontend holds the secret and serves.
        model = httpx.get(f"{frontend}/v1/models", timeout=10).json()["data"][0]["id"]
        answer = httpx.post(
            f"{frontend}/v1/completions",
            json={"model": model, "prompt": "hello", "max_tokens": 3},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
    # Thousands of refused connections and bad frames, a few throttled lines.
    figures["worker_log_lines"] = len((tmp_path / "w.log").read_text().splitlines())
    assert figures["worker_log_lines"] < 100, figures
    print(json.dumps(figures))


async def _abuse(
    address: str, host: str, port: int, pid: int, etcd_url: str, namespace: str
) -> dict[str, float]:
    plane = RequestPlaneClient(security=PlaneSecurity(secret=SECRET.encode()))
    worker = TcpWorkerClient(plane, address)
    try:
        await measure(worker, "warm", 5)
        baseline = statistics.median(await measure(worker, "base", 20))
        rss_before = rss_kb(pid)

        attacker = Attacker(host, port)
        attacker.start()
        started = time.monotonic()
        under_attack: list[float] = []
        while time.monotonic() - started < 2 * LEASE_TTL + 2 or attacker.counts["floods"] < 2:
            under_attack += await measure(worker, f"attack-{len(under_attack)}", 5)
        attacker.stop.set()
        await asyncio.to_thread(attacker.join, 60)
        rss_after = rss_kb(pid)
        still_listed = [i.instance_id for i in await listed(etcd_url, namespace)]

        # No secret: the handshake fails, nothing runs.
        stranger = RequestPlaneClient(connect_timeout=2.0)
        with pytest.raises(EngineError) as refused:
            await ttft(TcpWorkerClient(stranger, address), "stranger")
        await stranger.close()

        # Another request's hashes, with different tokens, never buy its cache.
        victim = list(range(5000, 5000 + 12 * 64))
        await anext(worker.generate(WorkerRequest(request_id="victim", token_ids=victim, max_tokens=1)))
        forged = WorkerRequest(
            request_id="forged",
            token_ids=list(range(9000, 9000 + len(victim))),
            max_tokens=1,
            block_hashes=block_hashes(victim, 64),
        )
        with pytest.raises(EngineError) as forged_refused:
            await anext(worker.generate(forged))
    finally:
        await plane.close()

    attacked = statistics.median(under_attack)
    figures = {
        "baseline_ttft_ms": round(baseline * 1e3, 2),
        "under_attack_ttft_ms": round(attacked * 1e3, 2),
        "rss_growth_mb": round((rss_after - rss_before) / 1024, 1),
        "attack_s": round(time.monotonic() - started, 1),
        **attacker.counts,
    }
    assert still_listed == ["w"], figures
    # Generous: within 2x of the baseline, or 20 ms of it when the baseline is tiny.
    assert attacked <= max(2 * baseline, baseline + 0.02), figures
    assert rss_after - rss_before < 50 * 1024, figures
    assert attacker.counts["big_frames"] >= 1 and attacker.counts["garbage"] >= 1, figures
    assert attacker.counts["refused_in_flood"] >= 1, figures  # the per-peer cap held
    assert refused.value.code == "unavailable"
    assert forged_refused.value.code == "invalid_request"
    return figures
