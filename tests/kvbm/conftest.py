"""Fixtures of the G4 tests: a free port, and a redis-server on one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kvbm.redis_server import REDIS_SERVER, redis_on
from tests.servers import free_port


@pytest.fixture
def port() -> int:
    if not Path(REDIS_SERVER).exists():
        pytest.skip(f"{REDIS_SERVER} not found: install Debian's redis-server")
    return free_port()


@pytest.fixture
def url(port: int, tmp_path: Path) -> Iterator[str]:
    with redis_on(port, tmp_path):
        yield f"redis://127.0.0.1:{port}"
