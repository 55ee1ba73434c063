"""`weir frontend --processes N`: N whole frontends behind one port, watched by a supervisor,
over real etcd, NATS and a mocker worker, seen through the port and /proc."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from orchestrator.cli.processes import Supervisor, default_processes, usable_cores
from tests.cli.procs import stop, wait_banner, weir, weir_process
from tests.cluster import known_workers, metric, planes, start_workers
from tests.waiting import wait_until

MODEL = "smollm2-135m-instruct"  # the mocker's default card


def children(pid: int) -> set[int]:
    return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def serving_pids(port: int) -> dict[int, int]:
    """Which processes hold the server ends of established connections to `port`: pid -> count
    (from /proc/net/tcp's socket inodes and each process's fds)."""
    inodes: set[str] = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # local port, ESTABLISHED
            inodes.add(fields[9])
    held: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except (FileNotFoundError, PermissionError):
            continue
        count = sum(link[8:-1] in inodes for link in links if link.startswith("socket:["))
        if count:
            held[int(pid)] = count
    return held


@contextmanager
def frontend(
    tmp_path: Path, plane_args: list[str], *args: str, processes: int = 2
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    log = tmp_path / "frontend.log"
    with weir_process(
        "frontend", *plane_args, "--port", "0", "--processes", str(processes), *args, log=log
    ) as proc:
        url = wait_banner(proc, log)
        yield url, proc


@pytest.fixture
def cluster(etcd_url: str, nats_url: str, tmp_path: Path) -> Iterator[tuple[list[str], ExitStack]]:
    plane_args = planes(etcd_url, nats_url, "processes")
    with ExitStack() as stack:
        start_workers(stack, plane_args, tmp_path, ("worker-a",), speedup=1)
        yield plane_args, stack


def _lists_a_model(client: httpx.Client) -> bool:
    return bool(client.get("/v1/models").json()["data"])


def complete(url: str, max_tokens: int = 4) -> str:
    # A client of its own: its own connection, which the kernel may give to either process.
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        answer = client.completions.create(model=MODEL, prompt="one two three", max_tokens=max_tokens)
    return answer.choices[0].text


def test_every_process_takes_connections_and_each_ones_metrics_count_all(
    cluster: tuple[list[str], ExitStack], tmp_path: Path
) -> None:
    plane_args, _ = cluster
    with frontend(tmp_path, plane_args) as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        kids = children(proc.pid)
        assert len(kids) == 2
        # The worker may register after the frontend started; each process learns of it.
        wait_until(lambda: known_workers(url) == 1, "a frontend process to know the worker", 30)
        # 24 connections held open at once: the kernel spreads them over both processes.
        clients = [httpx.Client(base_url=url, timeout=30) for _ in range(24)]
        try:
            for client in clients:
                wait_until(functools.partial(_lists_a_model, client), "each process to list the model", 30)
            held = serving_pids(port)
            assert set(held) == kids, held
            with ThreadPoolExecutor(8) as pool:
                assert all(pool.map(lambda _: complete(url), range(16)))
            # Any process's /metrics answers for both: every fresh scrape sees all 16.
            for client in clients[:6]:
                text = client.get("/metrics").text
                ok = 'endpoint="completions",status="200"'
                assert metric(text, "weir_frontend_requests_total", ok) == 16
                assert metric(text, "weir_frontend_workers") == 1
        finally:
            for client in clients:
                client.close()
        assert stop(proc) == 0
        assert not any(alive(kid) for kid in kids)


def test_a_process_that_dies_is_replaced_and_the_port_keeps_serving(
    cluster: tuple[list[str], ExitStack], tmp_path: Path
) -> None:
    plane_args, _ = cluster
    with frontend(tmp_path, plane_args) as (url, proc):
        first = children(proc.pid)
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        # The survivor takes every new connection meanwhile.
        assert all(complete(url) for _ in range(5))
        wait_until(lambda: len(children(proc.pid) - first) == 1, "a replacement process", 60, proc=proc)
        assert children(proc.pid) & first == first - {victim}
        log = (tmp_path / "frontend.log").read_text()
        assert f"exited with -{int(signal.SIGKILL)}; restarting" in log
        assert all(complete(url) for _ in range(5))


def test_sigterm_lets_in_flight_streams_finish_and_stops_every_process(
    cluster: tuple[list[str], ExitStack], tmp_path: Path
) -> None:
    plane_args, _ = cluster
    with frontend(tmp_path, plane_args) as (url, proc):
        kids = children(proc.pid)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            stream = client.completions.create(
                model=MODEL, prompt="count", max_tokens=150, stream=True, extra_body={"ignore_eos": True}
            )
            chunks = iter(stream)
            first = next(chunks)  # the request is in flight on one of the processes
            proc.send_signal(signal.SIGTERM)
            rest = list(chunks)
        finish = [c.choices[0].finish_reason for c in [first, *rest] if c.choices]
        assert finish[-1] == "length"
        assert proc.wait(timeout=60) == 0
        assert not any(alive(kid) for kid in kids)


def test_children_die_with_a_killed_supervisor(cluster: tuple[list[str], ExitStack], tmp_path: Path) -> None:
    plane_args, _ = cluster
    with frontend(tmp_path, plane_args) as (_, proc):
        kids = children(proc.pid)
        proc.kill()
        proc.wait(timeout=10)
        wait_until(lambda: not any(alive(kid) for kid in kids), "the children to exit", 30)
    # The killed supervisor left its metrics directory; the next one to start removes it.
    orphans = list(Path(tempfile.gettempdir()).glob(f"weir-frontend-metrics-{proc.pid}-*"))
    assert len(orphans) == 1
    with tempfile.TemporaryDirectory(prefix=f"weir-frontend-metrics-{os.getpid()}-") as live:
        assert Supervisor(exit_at_once, 3, processes=1, drain_timeout_s=1).run(lambda: None) == 3
        assert not orphans[0].exists() and Path(live).exists()  # a running supervisor's stays


def test_the_probe_port_is_shared_too(cluster: tuple[list[str], ExitStack], tmp_path: Path) -> None:
    plane_args, _ = cluster
    with socket.socket() as reserved:
        reserved.bind(("127.0.0.1", 0))
        probe_port = reserved.getsockname()[1]
    with frontend(tmp_path, plane_args, "--probe-port", str(probe_port)) as (_, proc):
        for _ in range(6):
            answer = httpx.get(f"http://127.0.0.1:{probe_port}/health", timeout=5)
            assert answer.status_code == 200 and answer.json()["workers"] == 1
        assert len(children(proc.pid)) == 2


def test_a_port_someone_else_listens_on_is_refused(etcd_url: str, nats_url: str) -> None:
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # would share, if we let it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = weir("frontend", *planes(etcd_url, nats_url, "taken"), "--port", str(port), "--processes", "2")
    assert done.returncode != 0
    assert "cannot listen on 127.0.0.1" in done.stderr and "in use" in done.stderr


def test_processes_must_be_positive_and_default_to_the_usable_cores() -> None:
    done = weir("frontend", "--processes", "0")
    assert done.returncode == 2 and "must be at least 1" in done.stderr
    assert 1 <= default_processes() == min(4, usable_cores()) <= len(os.sched_getaffinity(0))


def exit_at_once(code: int, ready: Callable[[], None]) -> None:
    """A child that fails before it serves (a `Supervisor` target: module-level, picklable)."""
    raise SystemExit(code)


def test_a_child_that_fails_before_it_serves_stops_the_supervisor() -> None:
    announced: list[bool] = []
    supervisor = Supervisor(exit_at_once, 3, processes=2, drain_timeout_s=1)
    assert supervisor.run(lambda: announced.append(True)) == 3
    assert not announced and not supervisor.metrics_dir.exists()
