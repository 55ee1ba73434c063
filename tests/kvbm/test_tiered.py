"""TieredStore's policy over real stores: write-through to host memory, disk only for blocks
that were reused, prefix walks that stop at the first gap, promotion to host memory, one KV
event per store and removal with its tier, and a damaged block counted and served as a miss."""

from __future__ import annotations

from pathlib import Path

from kvbm import metrics, records
from kvbm.disk import DiskStore
from kvbm.stores import HostStore
from kvbm.tiered import TieredStore
from orchestrator.runtime.protocol import BlockRemoved, BlockStored, KvEvent, Tier

BLOCK = 64


def payload(seq_hash: int) -> bytes:
    return bytes([seq_hash % 251]) * BLOCK


def tiers(tmp_path: Path, host_blocks: int, disk_min_reuse: int = 1) -> TieredStore:
    disk = DiskStore(tmp_path, 16, BLOCK, layout=7)
    return TieredStore(HostStore(host_blocks, BLOCK), disk=disk, disk_min_reuse=disk_min_reuse)


def by_tier(events: list[KvEvent]) -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for event in events:
        if isinstance(event, BlockStored):
            out.setdefault(("stored", event.tier), []).extend(event.blocks)
        elif isinstance(event, BlockRemoved):
            out.setdefault(("removed", event.tier), []).extend(event.seq_hashes)
    return out


def test_write_through_and_a_prefix_walk_that_stops_at_the_first_gap(tmp_path: Path) -> None:
    store = tiers(tmp_path, host_blocks=8)
    store.offload([(1, payload(1)), (2, payload(2)), (4, payload(4))])
    assert by_tier(store.take_events()) == {("stored", "host"): [1, 2, 4]}
    memo: dict[int, tuple[Tier, bytes]] = {}
    found = store.fetch_prefix([1, 2, 3, 4], memo)
    assert found == [(1, "host", payload(1)), (2, "host", payload(2))]
    # What was read is kept for the sequence's next attempt: nothing is read twice.
    hits = metrics.HITS.labels("host")._value.get()
    assert store.fetch_prefix([1, 2], memo) == found
    assert metrics.HITS.labels("host")._value.get() == hits


def test_host_evictions_reach_disk_only_when_reused(tmp_path: Path) -> None:
    store = tiers(tmp_path, host_blocks=2)
    store.offload([(1, payload(1)), (2, payload(2))])
    store.onboarded(store.fetch_prefix([1], {}))  # block 1 was loaded back once: worth keeping
    store.take_events()
    store.offload([(3, payload(3)), (4, payload(4))])  # host memory drops 1 and 2
    events = by_tier(store.take_events())
    assert sorted(events[("removed", "host")]) == [1, 2]
    assert events[("stored", "disk")] == [1]  # 2 was never reused: dropped, not written
    assert store.disk is not None and 1 in store.disk and 2 not in store.disk
    # A disk hit is copied up to host memory, so the next one is a memory copy.
    assert store.fetch_prefix([1], {}) == [(1, "disk", payload(1))]
    assert 1 in store.host
    assert ("stored", "host") in by_tier(store.take_events())
    assert set(store.snapshot()) == {"host", "disk"}


def test_a_damaged_disk_block_is_a_miss_and_counted(tmp_path: Path) -> None:
    store = tiers(tmp_path, host_blocks=1, disk_min_reuse=0)
    store.offload([(1, payload(1)), (2, payload(2))])  # 1 falls to disk as 2 arrives
    assert store.disk is not None and 1 in store.disk
    assert isinstance(store.disk, DiskStore)
    slab = bytearray(store.disk.path.read_bytes())
    for slot in range(len(slab) // store.disk.slot_bytes):  # one payload byte in every slot
        slab[slot * store.disk.slot_bytes + records.HEADER_BYTES + 10] ^= 0x01
    store.disk.path.write_bytes(bytes(slab))
    errors = metrics.ERRORS.labels("disk")._value.get()
    assert store.fetch_prefix([1, 2], {}) == []  # the walk stops at the damaged first block
    assert metrics.ERRORS.labels("disk")._value.get() == errors + 1
    assert 1 not in store.disk
