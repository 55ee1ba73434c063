"""Hostile inputs against a real `weir serve --backend mocker`: each gets a 4xx (or, for
connections the server will not hold, a closed connection), while a normal request keeps
succeeding, `/health` keeps answering fast and the server's memory stays bounded.

Prints one JSON line of figures: /health p99 and max over the run, the server's RSS before and
after, and the log lines written."""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.cli.procs import wait_healthy, weir_process
from tests.servers import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MAX_CONNECTIONS = 64
READ_TIMEOUT_S = 2.0
STALL_TIMEOUT_S = 2.0


class Server:
    def __init__(self, base_url: str, pid: int, log: Path, model: str) -> None:
        self.base_url = base_url
        self.process = psutil.Process(pid)
        self.log = log
        self.model = model

    def post(self, path: str, body: dict[str, Any], timeout: float = 60.0) -> httpx.Response:
        return httpx.post(f"{self.base_url}{path}", json={"model": self.model, **body}, timeout=timeout)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("chaos") / "serve.log"
    args = [
        "serve", "--backend", "mocker", "--speedup", "1000", "--workers", "1", "--port", str(port),
        "--max-connections", str(MAX_CONNECTIONS), "--read-timeout", str(READ_TIMEOUT_S),
        "--stream-stall-timeout", str(STALL_TIMEOUT_S), "--max-stop-strings", "16",
    ]  # fmt: skip
    with weir_process(*args, log=log) as proc:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, proc, log)
        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        yield Server(base_url, proc.pid, log, model)


class Background:
    """/health polled every 10 ms (latencies kept) and a normal chat request in a loop."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.health_ms: list[float] = []
        self.normal_ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._health), threading.Thread(target=self._normal)]

    def __enter__(self) -> Background:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _health(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(0.01):
                start = time.perf_counter()
                status = client.get(f"{self.server.base_url}/health").status_code
                self.health_ms.append((time.perf_counter() - start) * 1000)
                if status != 200:
                    self.failures.append(f"/health {status}")

    def _normal(self) -> None:
        body = {"model": self.server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        # One kept-alive connection, opened before the attacks: the connection cap may refuse
        # new ones while slowloris connections fill it, never one already being served.
        with httpx.Client(timeout=60) as client:
            self._loop(client, body)

    def _loop(self, client: httpx.Client, body: dict[str, Any]) -> None:
        while not self._stop.is_set():
            reply = client.post(f"{self.server.base_url}/v1/chat/completions", json=body)
            if reply.status_code == 200:
                self.normal_ok += 1
            else:
                self.failures.append(f"normal request {reply.status_code}: {reply.text[:200]}")


def _assert_4xx(response: httpx.Response) -> None:
    assert 400 <= response.status_code < 500, response.text[:500]
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@functools.cache
def _large_bodies(model: str) -> dict[str, bytes]:
    """About 10 MB each, in the shapes that cost a validator the most per byte (seconds each).
    Encoded before /health is measured: encoding them would hold this process's GIL, and with
    it the probing thread."""
    shapes: dict[str, dict[str, Any]] = {
        "strings": {"prompt": ["a"] * 2_000_000},
        "one-item lists": {"prompt": [[1]] * 1_600_000},
        "logit_bias keys": {"prompt": "x", "logit_bias": {str(i): 1 for i in range(800_000)}},
        "stop strings": {"prompt": "x", "stop": ["ab"] * 1_500_000},
        "token ids": {"prompt": list(range(1_200_000))},
    }
    return {
        name: json.dumps({"model": model, "max_tokens": 1, **body}).encode() for name, body in shapes.items()
    }


def _post_raw(server: Server, body: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.base_url}/v1/completions", content=body, headers=headers, timeout=60)


def _huge_prompt_list(server: Server) -> None:
    _assert_4xx(_post_raw(server, _large_bodies(server.model)["strings"]))


def _costly_shapes(server: Server) -> None:
    for name, body in _large_bodies(server.model).items():
        if name != "strings":
            _assert_4xx(_post_raw(server, body))


def _many_stop_strings(server: Server) -> None:
    stops = [f"stop-{i}" for i in range(20_000)]
    _assert_4xx(server.post("/v1/completions", {"prompt": "x", "n": 16, "stop": stops}))


def _bad_messages(server: Server) -> None:
    for messages, extra in (
        ([{"role": "user"}], {}),
        ([{"role": "user", "content": None}], {}),
        ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"messages": []}}),
        ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"add_generation_prompt": 1}}),
    ):
        _assert_4xx(server.post("/v1/chat/completions", {"messages": messages, **extra}))
    # Templates that ignore tool calls may accept these; none may fail with a 5xx.
    bad_calls = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"function": 5}]}]
    assert server.post("/v1/chat/completions", {"messages": bad_calls, "max_tokens": 2}).status_code < 500


def _unknown_fields(server: Server) -> None:
    for r in range(100):
        extra = {f"x{r}-{i}-{'n' * 100}": 1 for i in range(5_000)}
        reply = server.post("/v1/completions", {"prompt": "x", "max_tokens": 1, **extra})
        assert reply.status_code == 200, reply.text[:300]


def _slowloris(server: Server) -> None:
    port = int(server.base_url.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        for s in socks:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        # Past the cap at once, the rest once the header timeout passes: every one is closed.
        for s in socks:
            s.settimeout(READ_TIMEOUT_S * 5)
            with contextlib.suppress(ConnectionResetError):  # dropped with a reset: closed too
                assert s.recv(1) == b""
    finally:
        for s in socks:
            s.close()


def _slow_reader(server: Server) -> None:
    disconnects = server.metric("weir_frontend_client_disconnects_total")
    port = int(server.base_url.rsplit(":", 1)[1])
    body = json.dumps(
        {
            "model": server.model,
            "prompt": "x",
            "n": 16,
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    try:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        # Never read: the stream stalls and the server gives up on it.
        wait_until(
            lambda: server.metric("weir_frontend_client_disconnects_total") > disconnects,
            "the stalled stream to be cancelled",
            timeout=STALL_TIMEOUT_S * 15,
        )
    finally:
        sock.close()


# Validated on the event loop, each of these bodies held it 0.3-3.4 s (bodies.py); offloaded,
# /health stays well under this bound.
LOOP_BOUND_MS = 150.0
BOUNDED = ("huge prompt list", "10 MB bodies of the costliest shapes")

HOSTILE: dict[str, Callable[[Server], None]] = {
    "huge prompt list": _huge_prompt_list,
    "10 MB bodies of the costliest shapes": _costly_shapes,
    "20,000 stop strings, n=16": _many_stop_strings,
    "bad messages and template kwargs": _bad_messages,
    "100 x 5,000 unknown fields": _unknown_fields,
    "slowloris beyond the connection cap": _slowloris,
    "slow reader": _slow_reader,
}


def test_hostile_inputs_leave_the_server_serving(server: Server) -> None:
    _large_bodies(server.model)
    rss_before = server.process.memory_info().rss
    timings: dict[str, float] = {}
    health_max: dict[str, float] = {}
    rss_mb: dict[str, int] = {}
    reruns: list[str] = []
    with Background(server) as background:

        def run(name: str) -> None:
            start = time.perf_counter()
            probes = len(background.health_ms)
            HOSTILE[name](server)
            timings[name] = round(time.perf_counter() - start, 2)
            worst = round(max(background.health_ms[probes:], default=0.0), 1)
            health_max[name] = min(worst, health_max.get(name, worst))
            rss_mb[name] = round(server.process.memory_info().rss / 2**20)

        for name in HOSTILE:
            run(name)
            # One slow probe on a shared 2-core machine is noise; a body validated on the loop
            # holds it again on every try.
            if name in BOUNDED and health_max[name] >= LOOP_BOUND_MS:
                reruns.append(name)
                run(name)
    rss_after = server.process.memory_info().rss
    log_lines = len(server.log.read_text().splitlines())
    health = sorted(background.health_ms)
    p99 = health[int(len(health) * 0.99)]
    figures = {
        "health_probes": len(health),
        "health_p99_ms": round(p99, 1),
        "health_max_ms": round(health[-1], 1),
        "normal_requests_ok": background.normal_ok,
        "rss_before_mb": round(rss_before / 2**20),
        "rss_after_mb": round(rss_after / 2**20),
        "log_lines": log_lines,
        "attack_seconds": timings,
        "health_max_ms_by_attack": health_max,
        "rss_mb_after_attack": rss_mb,
        "reruns": reruns,
    }
    print(json.dumps(figures))
    assert not background.failures, background.failures[:5]
    assert background.normal_ok > 0
    assert p99 < 100, figures
    for attack in BOUNDED:
        assert health_max[attack] < LOOP_BOUND_MS, figures
    # Parsing the 8 MB prompt list alone takes a few hundred MB, which the allocator keeps.
    assert rss_after - rss_before < 600 * 2**20, figures
    assert log_lines < 200, server.log.read_text()[-3000:]
