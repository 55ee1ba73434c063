"""RedisStore against a real redis-server: blocks shared between workers, damage as a miss,
and an outage that costs hit rate, one warning, and nothing else."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import pytest
import redis

from kvbm import redis_store
from kvbm.redis_store import RedisStore
from tests.kvbm.redis_server import redis_on
from tests.kvbm.threads import at_once
from tests.waiting import wait_until

LAYOUT = 0xABC
BLOCK = 4096


def block(i: int) -> bytes:
    return (f"kv-{i:04d}.".encode() * (BLOCK // 8 + 1))[:BLOCK]


def test_round_trip(url: str) -> None:
    store = RedisStore(url, LAYOUT, BLOCK)
    assert store.tier == "remote" and store.available
    assert 1 not in store and store.get(1) is None
    assert store.put(1, block(1)) == []
    assert 1 in store and store.get(1) == block(1)
    store.discard(1)
    assert 1 not in store
    with pytest.raises(ValueError):
        store.put(2, b"short")
    key = store.key(1)
    assert key == f"weir:kv:{LAYOUT:016x}:{1:016x}"
    store.put(1, block(1))
    assert 0 < redis.Redis.from_url(url).ttl(key) <= 3600
    store.close()


def test_pipelined_get_many_and_put_many(url: str) -> None:
    store = RedisStore(url, LAYOUT, BLOCK)
    store.put_many((i, block(i)) for i in range(0, 20, 2))
    got = store.get_many(range(20))
    assert got == [block(i) if i % 2 == 0 else None for i in range(20)]
    store.put_many([])
    assert store.get_many([]) == []
    store.close()


def test_a_damaged_value_is_a_miss_and_deleted(url: str, caplog: pytest.LogCaptureFixture) -> None:
    store = RedisStore(url, LAYOUT, BLOCK)
    raw = redis.Redis.from_url(url)
    store.put_many([(1, block(1)), (2, block(2))])
    raw.set(store.key(1), b"garbage, not a record")
    value = raw.get(store.key(2))
    assert isinstance(value, bytes)
    record = bytearray(value)
    record[-1] ^= 0x01
    raw.set(store.key(2), bytes(record))
    assert store.get_many([1, 2]) == [None, None]
    assert raw.exists(store.key(1), store.key(2)) == 0
    assert "failed their check" in caplog.text
    # A block of another layout never answers for this one, though the hash is the same.
    other = RedisStore(url, LAYOUT + 1, BLOCK)
    other.put(3, block(3))
    raw.copy(other.key(3), store.key(3))
    assert store.get(3) is None and other.get(3) == block(3)
    store.close()
    other.close()


def test_a_full_redis_is_a_miss_and_the_store_stays_on(url: str, caplog: pytest.LogCaptureFixture) -> None:
    raw = redis.Redis.from_url(url)
    store = RedisStore(url, LAYOUT, BLOCK)
    store.put(0, block(0))
    used = int(raw.info("memory")["used_memory"])
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", used + 20 * BLOCK)
    for i in range(1, 100):  # no raise: refused SETs are dropped
        assert store.put(i, block(i)) == []
    store.put_many((i, block(i)) for i in range(100, 200))
    assert "refused a command" in caplog.text and "maxmemory" in caplog.text
    assert store.available and store.get(0) == block(0)
    store.close()


def test_two_workers_share_blocks(url: str) -> None:
    first, second = RedisStore(url, LAYOUT, BLOCK), RedisStore(url, LAYOUT, BLOCK)
    first.put(42, block(42))
    assert 42 in second and second.get(42) == block(42)
    second.discard(42)
    assert 42 not in first
    first.close()
    second.close()


def test_an_outage_is_a_miss_with_one_warning_and_recovers(
    port: int, tmp_path: Path, quick_outages: pytest.LogCaptureFixture
) -> None:
    caplog = quick_outages
    url = f"redis://127.0.0.1:{port}"
    with redis_on(port, tmp_path) as server:
        store = RedisStore(url, LAYOUT, BLOCK)
        store.put(1, block(1))
        assert store.get(1) == block(1)
        server.kill()
        server.wait()
        assert store.get(1) is None
        assert not store.available
        # Down: every call is a miss or a no-op, through several failed PINGs, and no more warnings.
        wait_until(
            lambda: store.get(1) is None and store._backoff_s == redis_store.BACKOFF_MAX_S,
            "failed PINGs to double the back-off to its cap",
        )
        for _ in range(20):
            assert store.get(1) is None and 1 not in store
            assert store.get_many([1, 2]) == [None, None]
            assert store.put(2, block(2)) == []
            store.put_many([(3, block(3))])
            store.discard(1)
        assert not store.available
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    with redis_on(port, tmp_path):
        # The same object comes back by itself once Redis answers (its data went with it).
        wait_until(lambda: store.get(1) is None and store.available, "the store to come back")
        store.put(1, block(1))
        assert store.get(1) == block(1)
        assert "answers again" in caplog.text
        store.close()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_a_hung_server_costs_one_timeout(port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_store, "BACKOFF_START_S", 0.05)
    with redis_on(port, tmp_path) as server:
        store = RedisStore(f"redis://127.0.0.1:{port}", LAYOUT, BLOCK, timeout_s=0.2)
        store.put(1, block(1))
        server.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert store.get(1) is None
            assert time.monotonic() - started < 1.0  # redis-py's own retries are off
            assert not store.available
        finally:
            server.send_signal(signal.SIGCONT)
        wait_until(lambda: store.get(1) == block(1), "the store to come back")
        assert store.available
        store.close()


def test_threads_share_one_store(url: str) -> None:
    # The transfer engine's pool: pipelines from several threads at once, each on a
    # connection of its own from the client's pool, none seeing another's replies.
    store = RedisStore(url, LAYOUT, BLOCK)

    def work(t: int) -> None:
        mine = range(t * 100, t * 100 + 40)
        for start in range(0, 40, 8):
            store.put_many((i, block(i)) for i in mine[start : start + 8])
            assert store.get_many(mine[: start + 8]) == [block(i) for i in mine[: start + 8]]
        assert store.get_many([t * 100 + 99]) == [None]

    at_once(8, work)
    assert store.get_many(range(0, 800, 100)) == [block(i) for i in range(0, 800, 100)]
    assert len(redis.Redis.from_url(url).client_list()) > 2  # connections in flight together
    store.close()


def test_an_outage_met_by_many_threads_warns_once_and_one_ping_ends_it(
    port: int, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_store, "BACKOFF_START_S", 0.05)
    caplog.set_level(logging.INFO, logger="kvbm.redis_store")
    url = f"redis://127.0.0.1:{port}"
    with redis_on(port, tmp_path) as server:
        store = RedisStore(url, LAYOUT, BLOCK)
        store.put(1, block(1))
        server.kill()
        server.wait()

        def miss(_: int) -> None:
            for _ in range(20):
                assert store.get(1) is None

        at_once(8, miss)
        assert not store.available
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    with redis_on(port, tmp_path):

        def until_back(_: int) -> None:
            wait_until(lambda: store.get(1) is None and store.available, "the store to come back")

        at_once(8, until_back)
        assert caplog.text.count("remote tier back on") == 1
        store.close()
