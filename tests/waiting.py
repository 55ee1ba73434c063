"""Waiting for something to become true, for tests and benchmarks: one polling loop, sync and
async, plus the probes most waits use (a port accepting connections, an HTTP 200)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def wait_until(
    ready: Callable[[], bool],
    what: str = "the condition",
    timeout: float = 20.0,
    *,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    interval: float = 0.05,
) -> None:
    """Poll `ready` until it is true: TimeoutError after `timeout` s, RuntimeError at once if
    `proc` exits first. `what` names what is awaited ("the frontend to see 2 workers"); the
    tail of `log` ends either message, so a failed start-up shows why."""
    deadline = time.monotonic() + timeout
    while True:
        if ready():
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} while waiting for {what}{_tail(log)}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}{_tail(log)}")
        time.sleep(interval)


async def eventually(check: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01) -> None:
    """`wait_until` for a test running on the event loop: sleeps without blocking it."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(interval)


def wait_http_ok(
    url: str,
    timeout: float = 20.0,
    *,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    interval: float = 0.05,
) -> None:
    wait_until(lambda: http_ok(url), f"{url} to answer 200", timeout, proc=proc, log=log, interval=interval)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """GET `url` answers 200; False while nothing answers (refused, reset, timed out)."""
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(log: Path | None) -> str:
    return f":\n{log.read_text()[-3000:]}" if log is not None else ""
