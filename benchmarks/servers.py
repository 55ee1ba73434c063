"""Servers the benchmarks start as subprocesses: a free port, and a process held until its
health URL answers 200, then stopped with SIGTERM (SIGKILL after a minute)."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(
    cmd: list[str],
    health: str,
    log: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 600.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """`cmd` running with its output in `log`, once GET `health` answers 200."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd[:4])} exited; see {log}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(health, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(cmd[:4])} did not become healthy; see {log}")
            time.sleep(0.2)  # polling the health URL, not a synchronisation
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
