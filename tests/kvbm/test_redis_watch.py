"""RedisStore.watch against a real redis-server: the blocks Redis expires or evicts by itself,
and those it held before the store opened, reach the router's index as remote KV events;
a Redis that refuses CONFIG or goes away costs a warning or a reconnect, never a call."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvbm import redis_store
from kvbm.redis_store import RedisStore
from kvbm.stores import HostStore
from kvbm.tiered import TieredStore
from orchestrator.runtime.protocol import BlockRemoved, BlockStored, KvEventBatch, KvSnapshot
from router.block_index import BlockIndex
from router.indexer import KvIndexer
from tests.kvbm.redis_server import redis_on
from tests.kvbm.threads import WAIT_S
from tests.waiting import wait_until

LAYOUT = 0xABC
BLOCK = 4096


def block(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK


class Reports:
    """What a watched store reported, as the watcher thread hands it over."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stored: list[list[int]] = []
        self.removed: list[list[int]] = []
        self.cleared = 0
        self.gate = threading.Event()  # cleared: the watcher is held in its first removed report
        self.gate.set()

    def on_stored(self, hashes: list[int]) -> None:
        with self.lock:
            self.stored.append(hashes)

    def on_removed(self, hashes: list[int]) -> None:
        self.gate.wait(WAIT_S)
        with self.lock:
            self.removed.append(hashes)

    def on_cleared(self) -> None:
        with self.lock:
            self.cleared += 1

    def all_stored(self) -> list[int]:
        with self.lock:
            return [h for batch in self.stored for h in batch]

    def all_removed(self) -> list[int]:
        with self.lock:
            return [h for batch in self.removed for h in batch]


def watching(url: str, **kwargs: int) -> tuple[RedisStore, Reports]:
    """A watched store, once its watcher listens for both kinds of notification."""
    store = RedisStore(url, LAYOUT, BLOCK, **kwargs)
    reports = Reports()
    store.watch(reports.on_stored, reports.on_removed, reports.on_cleared)
    wait_until(lambda: subscribed(url), "the watcher to subscribe")
    return store, reports


def subscribed(url: str) -> bool:
    try:
        counts = redis.Redis.from_url(url).pubsub_numsub("__keyevent@0__:expired", "__keyevent@0__:evicted")
    except redis.ConnectionError:
        return False
    return all(n >= 1 for _, n in counts)


@pytest.fixture
def lru_url(port: int, tmp_path: Path) -> Iterator[str]:
    with redis_on(port, tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"):
        yield f"redis://127.0.0.1:{port}"


def test_an_expired_block_is_reported_and_another_layouts_is_not(url: str) -> None:
    raw = redis.Redis.from_url(url)
    store, reports = watching(url, ttl_s=1)
    assert "x" in str(raw.config_get("notify-keyspace-events")["notify-keyspace-events"])
    other = RedisStore(url, LAYOUT + 1, BLOCK)
    raw.set(other.key(2), b"a block of another model", px=20)
    wait_until(lambda: raw.exists(other.key(2)) == 0, "the other layout's block to expire")
    # Its notification went out before this block existed: the watcher has seen it first.
    store.put(1, block(1))
    wait_until(lambda: reports.all_removed() != [], "the expiry to be reported")
    assert reports.all_removed() == [1]
    assert store.get(1) is None and store.available
    store.close()
    other.close()


def test_evicted_blocks_are_reported_exactly(lru_url: str) -> None:
    raw = redis.Redis.from_url(lru_url)
    store, reports = watching(lru_url)
    reports.gate.clear()  # the notifications queue up behind the first report, as under load
    other = RedisStore(lru_url, LAYOUT + 1, BLOCK)
    for i in range(1000, 1200):  # another model's blocks, evicted too but never reported here
        other.put(i, block(i))
    store.put_many((i, block(i)) for i in range(2000))  # 8 MB into 4
    evicted = {i for i in range(2000) if not raw.exists(store.key(i))}
    assert evicted and len(evicted) < 2000
    reports.gate.set()
    wait_until(lambda: set(reports.all_removed()) == evicted, "every eviction to be reported")
    assert len(reports.all_removed()) == len(evicted)  # each once, and only this layout's
    assert len(reports.removed) < len(evicted) / 10  # in batches
    store.close()
    other.close()


def test_a_store_opened_later_reports_the_blocks_redis_holds(url: str) -> None:
    first = RedisStore(url, LAYOUT, BLOCK)
    first.put_many((i, block(i)) for i in range(2500))
    other = RedisStore(url, LAYOUT + 1, BLOCK)
    other.put(9999, block(1))
    second, reports = watching(url)
    held = set(range(2500))
    wait_until(lambda: set(reports.all_stored()) == held, "the scan to be reported")
    assert max(len(batch) for batch in reports.stored) <= redis_store.SCAN_COUNT
    # A snapshot lists none of them, and has them reported again.
    assert second.hashes() == []
    wait_until(lambda: set(Counter(reports.all_stored()).values()) == {2}, "the rescan to be reported")
    assert reports.cleared == 0  # it never lost track: nothing to forget
    for store in (first, other, second):
        store.close()


def test_a_redis_that_refuses_config_warns_once_and_still_serves(
    port: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://127.0.0.1:{port}"
    with redis_on(port, tmp_path, "--rename-command", "CONFIG", ""):
        RedisStore(url, LAYOUT, BLOCK).put(1, block(1))
        store, reports = watching(url)
        wait_until(lambda: reports.all_stored() == [1], "the scan to be reported")
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "notify-keyspace-events" in warnings[0], warnings
        store.put(2, block(2))
        assert store.get(2) == block(2) and store.available
        store.close()


def test_the_watcher_comes_back_with_redis(
    port: int, tmp_path: Path, quick_outages: pytest.LogCaptureFixture
) -> None:
    caplog = quick_outages
    url = f"redis://127.0.0.1:{port}"
    with redis_on(port, tmp_path) as server:
        store, reports = watching(url, ttl_s=1)
        server.kill()
        server.wait()
        assert store.get(1) is None  # the engine's calls see an outage, not an error
    with redis_on(port, tmp_path):
        # A fresh server: its notifications are off until the watcher turns them on again.
        wait_until(lambda: subscribed(url), "the watcher to subscribe again")
        wait_until(lambda: store.get(1) is None and store.available, "the store to come back")
        store.put(1, block(1))
        wait_until(lambda: reports.all_removed() == [1], "the expiry after the restart to be reported")
        assert reports.cleared == 1  # the fresh server holds nothing it reported before
        assert "watching its expiries and evictions" in caplog.text
        store.close()


def test_the_router_drops_an_expired_block_for_every_worker(url: str) -> None:
    # Worker a stores a block in G4 and Redis expires it; b only ever hears of it from a.
    tiers = TieredStore(HostStore(8, BLOCK), remote=RedisStore(url, LAYOUT, BLOCK, ttl_s=1))
    wait_until(lambda: subscribed(url), "the watcher to subscribe")
    index = BlockIndex()
    index.add_worker("a")
    index.add_worker("b")

    def publish() -> None:
        for event in tiers.take_events():
            if isinstance(event, BlockStored):
                index.store("a", event.blocks, event.tier)
            elif isinstance(event, BlockRemoved):
                index.remove("a", event.seq_hashes, event.tier)

    tiers.offload([(7, block(7))])
    publish()
    assert index.blocks_of("b") == {"remote": {7}}
    assert index.find_matches([7]).blocks == {"a": 1, "b": 1}

    def gone() -> bool:
        publish()
        return index.find_matches([7]).blocks == {"a": 1}  # a still holds it in host memory

    wait_until(gone, "the expiry to reach the index")
    assert index.blocks_of("b") == {} and index.blocks_of("a") == {"host": {7}}
    tiers.close()


def test_blocks_redis_dropped_while_unwatched_stop_being_credited(url: str) -> None:
    # Worker a's store reports block 7 and 9 as stored. Redis then drops 9 without a
    # notification (a DEL, as a restart or an eviction while nobody listens would), and the
    # watcher loses its connection: once it is back, the router credits 7 and no longer 9.
    remote = RedisStore(url, LAYOUT, BLOCK)
    tiers = TieredStore(HostStore(8, BLOCK), remote=remote)
    wait_until(lambda: subscribed(url), "the watcher to subscribe")
    indexer = KvIndexer()
    for worker in ("a", "b"):
        indexer.apply_snapshot(KvSnapshot(worker_id=worker, event_id=0, blocks={}))
    event_id = 0

    def publish() -> None:
        nonlocal event_id
        events = tiers.take_events()
        if events:
            event_id += 1
            indexer.apply_batch(KvEventBatch(worker_id="a", event_id=event_id, events=events))

    tiers.offload([(7, block(7)), (9, block(9))])
    publish()
    assert indexer.find_matches([7]).blocks == indexer.find_matches([9]).blocks == {"a": 1, "b": 1}
    raw = redis.Redis.from_url(url)
    assert raw.delete(remote.key(9)) == 1
    raw.client_kill_filter(_type="pubsub")

    def only_7_remote() -> bool:
        publish()
        return indexer.blocks.blocks_of("b") == {"remote": {7}}

    wait_until(only_7_remote, "the reconnected watcher's clear and rescan to reach the index")
    assert indexer.find_matches([9]).blocks == {"a": 1}  # a still holds 9 in host memory
    tiers.close()
