"""Shared fixtures: real servers started once per test session on free loopback ports."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.deepinfer.smollm2 import ensure_default_model, gguf_path
from tests.servers import etcd_server, nats_server, redis_server


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with etcd_server(tmp_path_factory.mktemp("etcd")) as url:
        yield url


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with nats_server(tmp_path_factory.mktemp("nats")) as url:
        yield url


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="session")
def mooncake() -> None:
    """Mooncake's transfer engine is installed (weir[mooncake]); the test skips, saying so,
    where it is not, except where WEIR_REQUIRE_MOONCAKE=1 (CI sets it): there it fails."""
    if importlib.util.find_spec("mooncake") is None:
        if os.environ.get("WEIR_REQUIRE_MOONCAKE") == "1":
            pytest.fail("WEIR_REQUIRE_MOONCAKE=1 but Mooncake's engine is not installed", pytrace=False)
        pytest.skip("Mooncake's transfer engine is not installed (pip install 'weir[mooncake]')")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted default model; reuses $WEIR_CACHE_DIR when set (CI caches it), else a
    per-session temporary cache (conversion takes ~5 s)."""
    try:
        gguf_path()
    except FileNotFoundError as exc:  # the package is an optional install (--no-deps)
        pytest.skip(str(exc))
    root = os.environ.get("WEIR_CACHE_DIR")
    return ensure_default_model(Path(root) if root else tmp_path_factory.mktemp("weir-cache"))
