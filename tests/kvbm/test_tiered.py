"""TieredStore's policy over real stores: write-through to host memory, disk only for blocks
that were reused, prefix walks that stop at the first gap, promotion to host memory, one KV
event per store and removal with its tier, and a damaged block counted and served as a miss."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvbm import metrics, records
from kvbm.disk import DiskStore
from kvbm.stores import HostStore
from kvbm.tiered import Fetch, TieredStore
from kvbm.transfer import TransferEngine
from orchestrator.runtime.protocol import BlockRemoved, BlockStored, KvEvent
from router.block_index import BlockIndex

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
    found, waiting = store.fetch_prefix([1, 2, 3, 4], Fetch())
    assert found == [(1, "host", payload(1)), (2, "host", payload(2))] and not waiting


def test_host_evictions_reach_disk_only_when_reused(tmp_path: Path) -> None:
    store = tiers(tmp_path, host_blocks=2)
    store.offload([(1, payload(1)), (2, payload(2))])
    store.onboarded(store.fetch_prefix([1], Fetch())[0])  # block 1 was loaded back once: worth keeping
    store.take_events()
    store.offload([(3, payload(3)), (4, payload(4))])  # host memory drops 1 and 2
    events = by_tier(store.take_events())
    assert sorted(events[("removed", "host")]) == [1, 2]
    assert events[("stored", "disk")] == [1]  # 2 was never reused: dropped, not written
    assert store.disk is not None and 1 in store.disk and 2 not in store.disk
    # A disk hit is kept for the sequence (a retry reads nothing twice) and, once the engine
    # takes it, copied up to host memory, so the next one is a memory copy.
    fetch = Fetch()
    assert store.fetch_prefix([1], fetch) == ([(1, "disk", payload(1))], False)
    reads = metrics.LOOKUPS.labels(store.worker, "disk")._value.get()
    assert store.fetch_prefix([1], fetch) == ([(1, "disk", payload(1))], False)
    assert metrics.LOOKUPS.labels(store.worker, "disk")._value.get() == reads
    store.onboarded([(1, "disk", payload(1))])
    assert 1 not in store.host  # not while the step that loads it runs (the next test)
    store.offload([])  # the step's end
    assert 1 in store.host
    assert ("stored", "host") in by_tier(store.take_events())
    assert set(store.snapshot()) == {"host", "disk"}


def test_a_step_larger_than_host_memory_passes_through_it_in_order(tmp_path: Path) -> None:
    """Blocks go into host slots a host's worth at a time, so each is stored before a later
    one evicts it: the router, applying the events in order, ends where the tiers are."""
    store = tiers(tmp_path, host_blocks=2, disk_min_reuse=0)
    store.offload([(h, payload(h)) for h in (1, 2, 3, 4, 5)])
    index = BlockIndex()
    for event in store.take_events():
        if isinstance(event, BlockStored):
            index.store("w", event.blocks, event.tier)
        elif isinstance(event, BlockRemoved):
            index.remove("w", event.seq_hashes, event.tier)
    assert index.blocks_of("w") == {"host": {4, 5}, "disk": {1, 2, 3}}
    assert store.disk is not None and set(store.disk.hashes()) == {1, 2, 3}
    assert [bytes(store.host.get(h) or b"") for h in (4, 5)] == [payload(4), payload(5)]
    with pytest.raises(ValueError, match="held already"):
        store.host.reserve(5)


def test_what_one_step_evicts_from_host_memory_goes_to_disk_in_one_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tiers(tmp_path, host_blocks=4, disk_min_reuse=0)
    store.offload([(h, payload(h)) for h in (1, 2, 3, 4)])
    writes: list[int] = []
    pwrite = os.pwrite
    monkeypatch.setattr(
        os, "pwrite", lambda fd, data, offset: writes.append(len(data)) or pwrite(fd, data, offset)
    )
    store.offload([(h, payload(h)) for h in (5, 6, 7)])  # evicts 1, 2 and 3 from host memory
    assert store.disk is not None
    assert writes == [3 * store.disk.slot_bytes]
    events = by_tier(store.take_events())
    assert events[("stored", "disk")] == [1, 2, 3]
    assert [store.disk.get(h) for h in (1, 2, 3)] == [payload(h) for h in (1, 2, 3)]


def test_a_host_hit_is_the_slot_itself_and_holds_until_the_step_ends(tmp_path: Path) -> None:
    """A host hit is a view of its slot (the device load is the one copy). Blocks the same
    step onboards from disk are copied up to host memory only at the step's end: put at once,
    they would evict the slots of the host hits the step is still loading."""
    store = tiers(tmp_path, host_blocks=2, disk_min_reuse=0)
    store.offload([(1, payload(1)), (2, payload(2)), (3, payload(3)), (4, payload(4))])
    assert store.disk is not None and {1, 2} <= set(store.disk.hashes())  # host keeps 3 and 4
    # One schedule: sequence A hits 3 and 4 in host memory, sequence B hits 1 and 2 on disk.
    hits, _ = store.fetch_prefix([3, 4], Fetch())
    assert [(h, tier) for h, tier, _ in hits] == [(3, "host"), (4, "host")]
    assert all(isinstance(p, memoryview) for _, _, p in hits)
    disk_hits, _ = store.fetch_prefix([1, 2], Fetch())
    store.onboarded(hits)
    store.onboarded(disk_hits)
    # The step loads A's blocks now: its views still hold 3 and 4, not B's copy-ups.
    assert [bytes(p) for _, _, p in hits] == [payload(3), payload(4)]
    store.offload([])
    assert 1 in store.host and 2 in store.host
    assert bytes(store.host.get(1) or b"") == payload(1)


def test_host_slots_can_live_in_memory_the_engine_gives() -> None:
    """A GPU engine hands the host store pinned memory: the slots are that memory, and a hit
    is a view of it; memory of the wrong size or read-only is refused."""
    memory = bytearray(2 * BLOCK)
    host = HostStore(2, BLOCK, buffer=memoryview(memory))
    host.put(7, payload(7))
    hit = host.get(7)
    assert hit is not None and isinstance(hit, memoryview) and hit.obj is memory
    assert payload(7) in memory
    for wrong in (memoryview(bytearray(BLOCK)), memoryview(bytes(2 * BLOCK))):
        with pytest.raises(ValueError, match="writable bytes"):
            HostStore(2, BLOCK, buffer=wrong)


def test_a_damaged_disk_block_is_a_miss_and_counted(tmp_path: Path) -> None:
    store = tiers(tmp_path, host_blocks=1, disk_min_reuse=0)
    store.offload([(1, payload(1)), (2, payload(2))])  # 1 falls to disk as 2 arrives
    assert store.disk is not None and 1 in store.disk
    assert isinstance(store.disk, DiskStore)
    slab = bytearray(store.disk.path.read_bytes())
    for slot in range(len(slab) // store.disk.slot_bytes):  # one payload byte in every slot
        slab[slot * store.disk.slot_bytes + records.HEADER_BYTES + 10] ^= 0x01
    store.disk.path.write_bytes(bytes(slab))
    errors = metrics.ERRORS.labels(store.worker, "disk")._value.get()
    assert store.fetch_prefix([1, 2], Fetch()) == ([], False)  # the walk stops at the damaged first block
    assert metrics.ERRORS.labels(store.worker, "disk")._value.get() == errors + 1
    assert 1 not in store.disk


def test_slow_tiers_run_on_the_transfer_thread_while_the_sequence_waits(tmp_path: Path) -> None:
    transfer = TransferEngine()
    disk = DiskStore(tmp_path, 16, BLOCK, layout=7)
    store = TieredStore(HostStore(1, BLOCK), disk=disk, disk_min_reuse=0, transfer=transfer)
    try:
        store.offload([(1, payload(1)), (2, payload(2)), (3, payload(3))])  # 1 and 2 fall to disk
        assert transfer.wait_idle(5)
        assert 1 in disk and 2 in disk and 3 in store.host
        fetch = Fetch()
        found, waiting = store.fetch_prefix([1, 2, 3, 9], fetch)
        assert (found, waiting) == ([], True)  # the read was started, not waited for
        assert transfer.wait_idle(5) and not fetch.running
        found, waiting = store.fetch_prefix([1, 2, 3, 9], fetch)
        assert not waiting
        assert found == [(1, "disk", payload(1)), (2, "disk", payload(2)), (3, "host", payload(3))]
    finally:
        store.close()


def test_a_full_transfer_queue_sheds_work_instead_of_waiting(tmp_path: Path) -> None:
    transfer = TransferEngine(max_pending=0)  # every job refused: a tier far slower than the engine
    disk = DiskStore(tmp_path, 16, BLOCK, layout=7)
    store = TieredStore(HostStore(1, BLOCK), disk=disk, disk_min_reuse=0, transfer=transfer)
    try:
        skipped = metrics.SKIPPED.labels(store.worker)._value.get()
        store.offload([(1, payload(1)), (2, payload(2))])
        assert metrics.SKIPPED.labels(store.worker)._value.get() == skipped + 1 and 1 not in disk
        disk.put(1, payload(1))  # on disk, but the queue is full: a miss now, not a wait
        assert store.fetch_prefix([1], Fetch()) == ([], False)
    finally:
        store.close()


def test_a_pool_of_transfers_keeps_the_disk_events_true_and_reads_prefixes_at_once(tmp_path: Path) -> None:
    transfer = TransferEngine(workers=4)
    disk = DiskStore(tmp_path, 16, BLOCK, layout=7)
    store = TieredStore(HostStore(1, BLOCK), disk=disk, disk_min_reuse=0, transfer=transfer)
    try:
        for i in range(1, 41):  # each offload drops the one before to disk: 39 writes, 23 evict
            store.offload([(i, payload(i))])
        assert transfer.wait_idle(5)
        # Replayed in order, the events say what the disk holds, though the writes ran on
        # four threads and each of the later ones evicted a block another had stored.
        on_disk: set[int] = set()
        for event in store.take_events():
            if isinstance(event, BlockStored) and event.tier == "disk":
                on_disk |= set(event.blocks)
            elif isinstance(event, BlockRemoved) and event.tier == "disk":
                on_disk -= set(event.seq_hashes)
        assert on_disk == set(disk.hashes()) and len(on_disk) == 16
        # Four sequences whose prefixes are on disk: four reads queued at once, all served.
        held = sorted(on_disk)
        prefixes = [held[i : i + 4] for i in range(0, 16, 4)]
        fetches = [Fetch() for _ in prefixes]
        assert all(store.fetch_prefix(p, f) == ([], True) for p, f in zip(prefixes, fetches, strict=True))
        assert transfer.wait_idle(5)
        for prefix, fetch in zip(prefixes, fetches, strict=True):
            assert store.fetch_prefix(prefix, fetch) == ([(h, "disk", payload(h)) for h in prefix], False)
    finally:
        store.close()
