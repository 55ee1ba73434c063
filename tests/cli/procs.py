"""Running `weir` commands as real subprocesses in tests, and stopping them cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

WEIR = [sys.executable, "-m", "orchestrator.cli.main"]
REPO = Path(__file__).resolve().parents[2]


def weir(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*WEIR, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False
    )


@contextmanager
def weir_process(
    *args: str, log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`weir ARGS` with output to `log`; on exit SIGTERM, then SIGKILL if it has not stopped in 15 s."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*WEIR, *args], stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})}
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_healthy(base_url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120.0) -> None:
    """Until GET /health answers 200 (the model is loaded and a worker is registered)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weir exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url}/health not ready after {timeout}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout=timeout)


def wait_banner(proc: subprocess.Popen[bytes], log: Path, timeout: float = 180.0) -> str:
    """The URL from the one line `weir serve`/`weir frontend` print once listening (--port 0)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if " on http://" in line:
                return line.rsplit(" on ", 1)[1].split()[0]
        if proc.poll() is not None:
            raise RuntimeError(f"weir exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    raise TimeoutError(f"no listening line after {timeout}s:\n{log.read_text()[-3000:]}")
