"""Shared fixtures: real servers started once per test session on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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
