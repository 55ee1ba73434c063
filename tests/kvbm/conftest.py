"""Fixtures of the G4 tests: a free port, a redis-server on one, and outages that pass quickly."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbm import redis_store
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


@pytest.fixture
def quick_outages(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> pytest.LogCaptureFixture:
    """A Redis that went away is retried after 50 ms doubling to 200 ms (not 1 s to 30 s), and
    the store's info lines are captured: the log an outage test reads."""
    monkeypatch.setattr(redis_store, "BACKOFF_START_S", 0.05)
    monkeypatch.setattr(redis_store, "BACKOFF_MAX_S", 0.2)
    caplog.set_level(logging.INFO, logger="kvbm.redis_store")
    return caplog
