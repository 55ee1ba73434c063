import socket
from urllib.parse import urlparse


def _reachable(url: str) -> bool:
    parsed = urlparse(url)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=2):
        return True


def test_servers_listen(etcd_url: str, nats_url: str, redis_url: str) -> None:
    assert all(_reachable(u) for u in (etcd_url, nats_url, redis_url))
