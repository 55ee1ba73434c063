"""DiskStore used from several threads at once, as the transfer engine's pool uses it: on a
slab file in tmpfs (memory speed, so threads really interleave), concurrent puts, gets (of one
block, and of prefixes read a run of slots at a time) and discards lose no block, never
return another block's bytes, and never let a write or a wipe land on a slot while a read of
it is in flight (which a read would see as a damaged block, logged as a failed check)."""

from __future__ import annotations

import logging
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbm import records
from kvbm.disk import DiskStore
from tests.kvbm.test_disk_store import BLOCK, LAYOUT, block
from tests.kvbm.threads import at_once

THREADS = 8


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A directory in /dev/shm (tmpfs) where there is one, else the test's own."""
    if not Path("/dev/shm").is_dir():
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        yield Path(directory)


def failed_checks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "failed its check" in r.getMessage()]


def test_concurrent_puts_and_gets_lose_and_corrupt_nothing(
    tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvbm.disk")
    store = DiskStore(tmpfs, 32, BLOCK, LAYOUT)
    puts = 150
    evicted: list[list[int]] = [[] for _ in range(THREADS)]

    def work(t: int) -> None:
        rng = random.Random(t)
        mine: list[int] = []
        for i in range(puts):
            seq_hash = t * 10_000 + i
            evicted[t] += store.put(seq_hash, block(seq_hash))
            mine.append(seq_hash)
            for other in [*rng.sample(mine, min(3, len(mine))), rng.randrange(THREADS * 10_000)]:
                got = store.get(other)
                assert got is None or got == block(other)
            # A prefix of this thread's latest blocks: their slots are often adjacent, one read.
            recent = mine[-4:]
            prefix = store.get_prefix(recent)
            assert [bytes(p) for p in prefix] == [block(h) for h in recent[: len(prefix)]]

    at_once(THREADS, work)
    everything = {t * 10_000 + i for t in range(THREADS) for i in range(puts)}
    gone = [h for hashes in evicted for h in hashes]
    held = store.hashes()
    assert len(gone) == len(set(gone))  # no block was evicted twice
    assert set(gone).isdisjoint(held) and set(gone) | set(held) == everything  # nor lost
    assert len(held) == 32
    assert all(store.get(h) == block(h) for h in held)
    store.close()
    reopened = DiskStore(tmpfs, 32, BLOCK, LAYOUT)
    assert sorted(reopened.hashes()) == sorted(held)
    assert all(reopened.get(h) == block(h) for h in held)
    reopened.close()
    assert failed_checks(caplog) == []


def test_no_slot_is_written_or_wiped_while_it_is_being_read(
    tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Readers read blocks 1 and 2 over and over, while other threads discard and put them
    # back and a writer fills the store with new blocks: writes and wipes keep meeting slots
    # that a read is in flight on. A write into one, or a wipe of its header, would fail that
    # read's check; the store must give the write another slot (or none) and wipe after it.
    caplog.set_level(logging.WARNING, logger="kvbm.disk")
    size = 1 << 18  # a read long enough for a write or a wipe to land in the middle of it
    payloads = {seq_hash: block(seq_hash, size) for seq_hash in (1, 2)}
    store = DiskStore(tmpfs, 3, size, LAYOUT)
    for seq_hash, payload in payloads.items():
        store.put(seq_hash, payload)
    rounds, readers = 1000, 4

    def work(t: int) -> None:
        for i in range(rounds):
            if t < readers:
                for seq_hash, payload in payloads.items():
                    got = store.get(seq_hash)
                    assert got is None or got == payload
                both = store.get_prefix([1, 2])  # one read where their slots are adjacent
                assert [bytes(p) for p in both] == [payloads[1], payloads[2]][: len(both)]
            elif t < readers + 2:
                seq_hash = t - readers + 1
                store.discard(seq_hash)
                store.put(seq_hash, payloads[seq_hash])
            else:
                store.put(1000 + i, payloads[1])

    at_once(readers + 3, work)
    assert failed_checks(caplog) == []
    for seq_hash in store.hashes():
        assert store.get(seq_hash) == payloads.get(seq_hash, payloads[1])
    store.close()


def test_a_slot_being_read_is_never_claimed_and_a_discard_waits_for_the_read(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 2, BLOCK, LAYOUT)
    store.put(1, block(1))
    store.put(2, block(2))
    [slot] = store._pin_prefix([1])  # a read of block 1 is in flight from here to _end_read
    assert store.get(2) == block(2)  # 1 is now the least recently used, but being read
    assert store.put(3, block(3)) == [2] and store.put(4, block(4)) == [3]
    store.discard(1)
    assert 1 not in store
    assert store.put(5, block(5)) == [4]  # the discarded block's slot is not free yet

    def record_in_slot() -> bytes:
        return store.path.read_bytes()[slot * store.slot_bytes :][: store.slot_bytes]

    assert records.decode(record_in_slot(), 1, LAYOUT) == block(1)  # what the read still sees
    [other] = store._pin_prefix([5])  # every slot being read: a put stores nothing rather than wait
    assert store.put(6, block(6)) == [] and 6 not in store
    store._end_read(other, None)
    store._end_read(slot, None)  # the read ends: the slot is wiped and freed
    assert records.decode(record_in_slot(), 1, LAYOUT) is None
    assert store.put(7, block(7)) == [] and sorted(store.hashes()) == [5, 7]
    store.close()
    assert sorted(DiskStore(tmp_path, 2, BLOCK, LAYOUT).hashes()) == [5, 7]
