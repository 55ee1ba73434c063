"""Running `weir` commands as real subprocesses in tests, and stopping them cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.servers import stop_process
from tests.waiting import wait_http_ok, wait_until

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
        stop_process(proc)


def wait_healthy(base_url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120.0) -> None:
    """Until GET /health answers 200 (the model is loaded and a worker is registered)."""
    wait_http_ok(f"{base_url}/health", timeout, proc=proc, log=log, interval=0.1)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout=timeout)


def wait_banner(proc: subprocess.Popen[bytes], log: Path, timeout: float = 180.0) -> str:
    """The URL from the one line `weir serve`/`weir frontend` print once listening (--port 0)."""
    urls: list[str] = []

    def printed() -> bool:
        lines = log.read_text().splitlines()
        urls.extend(line.rsplit(" on ", 1)[1].split()[0] for line in lines if " on http://" in line)
        return bool(urls)

    wait_until(printed, "the listening line", timeout, proc=proc, log=log, interval=0.1)
    return urls[0]
