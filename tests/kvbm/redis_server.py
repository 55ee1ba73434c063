"""A real redis-server for the G4 tests, on a port of the test's own."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.servers import stop_process, wait_for_port

REDIS_SERVER = "/usr/bin/redis-server"


@contextmanager
def redis_on(port: int, workdir: Path, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
    """A redis-server on `port` (with `extra` arguments), so that a test can kill it and start
    another on the same port."""
    args = [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    with (workdir / f"redis-{port}.log").open("ab") as out:
        proc = subprocess.Popen([*args, "--dir", str(workdir), *extra], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, proc=proc)
        yield proc
    finally:
        stop_process(proc, timeout=5)
