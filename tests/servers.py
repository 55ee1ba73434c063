"""Real etcd, NATS and Redis servers on 127.0.0.1 for tests: each on free ports, in a temp dir."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.certs import Certs
from tests.waiting import port_open, wait_until

# Ports handed out by free_port in this process, never handed out twice.
_handed_out: set[int] = set()
# Below the kernel's ephemeral range (32768-60999 on Linux by default) and above the local
# services a machine of this kind runs (PostgreSQL, Redis, NATS, RabbitMQ, ...).
_PORTS = range(20_000, 32_000)


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on, for a server a test starts. Not one the kernel
    picks (binding port 0): those come from the ephemeral range, which every outgoing
    connection draws from too, so such a port was once taken by a client connection before
    the server meant for it could bind (EADDRINUSE in CI)."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.choice(_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORTS.start}..{_PORTS.stop - 1}")


def wait_for_port(port: int, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    wait_until(lambda: port_open(port), f"127.0.0.1:{port} to listen", timeout, proc=proc)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def find_binary(name: str, *extra: str) -> str | None:
    for candidate in (shutil.which(name), *extra):
        if candidate and Path(candidate).exists():
            return candidate
    return None


@contextmanager
def _process(args: list[str], port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, proc=proc)
        yield proc
    finally:
        stop_process(proc, timeout=10)


@contextmanager
def etcd_server(workdir: Path, tls: Certs | None = None) -> Iterator[str]:
    """Yields the client URL, http://127.0.0.1:PORT; with `tls`, https://, serving `tls.cert`
    and requiring a client certificate signed by `tls.ca` (--client-cert-auth)."""
    binary = find_binary("etcd", "/usr/bin/etcd")
    if binary is None:
        raise RuntimeError("etcd not found: install Debian's etcd-server")
    client, peer = free_port(), free_port()
    scheme = "https" if tls else "http"
    args = [
        binary,
        "--name=default",
        f"--data-dir={workdir / 'etcd'}",
        f"--listen-client-urls={scheme}://127.0.0.1:{client}",
        f"--advertise-client-urls={scheme}://127.0.0.1:{client}",
        f"--listen-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-cluster=default=http://127.0.0.1:{peer}",
        "--log-level=error",
    ]
    if tls:
        args += [
            f"--cert-file={tls.cert}",
            f"--key-file={tls.key}",
            "--client-cert-auth",
            f"--trusted-ca-file={tls.ca}",
        ]
    with _process(args, client, workdir / "etcd.log"):
        yield f"{scheme}://127.0.0.1:{client}"


@contextmanager
def nats_server(workdir: Path, *options: str) -> Iterator[str]:
    """Yields nats://127.0.0.1:PORT, with JetStream enabled and nats-server's `options`
    (`--user`/`--pass`, `--tls ...`) added."""
    binary = find_binary("nats-server", "/usr/sbin/nats-server", "/usr/bin/nats-server")
    if binary is None:
        raise RuntimeError("nats-server not found: install Debian's nats-server")
    port = free_port()
    args = [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(workdir / "nats"), *options]
    with _process(args, port, workdir / "nats.log"):
        yield f"nats://127.0.0.1:{port}"


@contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """Yields redis://127.0.0.1:PORT."""
    binary = find_binary("redis-server", "/usr/bin/redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found: install Debian's redis-server")
    port = free_port()
    args = [
        binary,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]
    with _process(args, port, workdir / "redis.log"):
        yield f"redis://127.0.0.1:{port}"
