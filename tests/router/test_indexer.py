"""KV indexer: prefix matching, tiers, worker removal, gap detection and snapshot resync."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.runtime.protocol import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvSnapshot,
)
from router.block_index import BlockIndex
from router.indexer import KvIndexer


def batch(worker: str, event_id: int, *events: KvEvent) -> KvEventBatch:
    return KvEventBatch(worker_id=worker, event_id=event_id, events=list(events))


def test_longest_prefix_per_worker() -> None:
    index = BlockIndex()
    index.store("a", [1, 2, 3, 4, 5])
    index.store("b", [1, 2, 3])
    index.store("c", [2, 3, 4])  # holds later blocks but not the first: no prefix
    index.store("d", [1, 2, 4, 5])  # a hole at block 3 ends its prefix
    matches = index.find_matches([1, 2, 3, 4, 5, 6])
    assert matches.blocks == {"a": 5, "b": 3, "d": 2}
    assert matches.lower == {}
    assert index.find_matches([9, 1]).blocks == {}
    assert index.find_matches([]).blocks == {}


def test_lower_tiers_are_counted_apart() -> None:
    index = BlockIndex()
    index.store("a", [1, 2])
    index.store("a", [3, 4], "host")
    index.store("b", [1, 2, 3], "disk")
    index.store("b", [1], "device")  # on device and disk: a device hit
    matches = index.find_matches([1, 2, 3, 4])
    assert matches.blocks == {"a": 4, "b": 3}
    assert matches.lower == {"a": {"host": 2}, "b": {"disk": 2}}
    index.store("b", [2], "host")  # now also in b's host memory: counted at the faster tier
    assert index.find_matches([1, 2, 3, 4]).lower == {"a": {"host": 2}, "b": {"host": 1, "disk": 1}}
    index.remove("b", [2], "host")
    index.remove("a", [3], "host")
    assert index.find_matches([1, 2, 3, 4]).blocks == {"a": 2, "b": 3}
    index.remove("b", [1, 2, 3], "disk")
    assert index.find_matches([1, 2, 3]).blocks == {"a": 2, "b": 1}
    assert index.find_matches([1, 2, 3]).lower == {}


def test_a_remote_block_counts_for_every_worker_of_the_model() -> None:
    # G4 is one store shared by the model's workers: any of them can load what one put there.
    index = BlockIndex()
    index.store("a", [1, 2])
    index.store("b", [9])
    index.store("a", [1, 2, 3], "remote")
    matches = index.find_matches([1, 2, 3])
    assert matches.blocks == {"a": 3, "b": 3}
    assert matches.lower == {"a": {"remote": 1}, "b": {"remote": 3}}  # a holds 1 and 2 on its device
    index.remove("b", [3], "remote")  # gone from the shared store: gone for both
    assert index.find_matches([1, 2, 3]).blocks == {"a": 2, "b": 2}


def test_removed_worker_leaves_nothing_behind_and_its_slot_is_reused_cleanly() -> None:
    index = BlockIndex()
    index.store("a", [1, 2, 3])
    index.store("b", [1, 2])
    index.remove_worker("a")
    assert index.find_matches([1, 2, 3]).blocks == {"b": 2}
    index.store("c", [7])  # takes a's slot
    assert index.find_matches([1, 2, 3]).blocks == {"b": 2}
    assert index.find_matches([7]).blocks == {"c": 1}
    index.remove_worker("b")
    index.remove_worker("c")
    assert len(index) == 0


def test_in_order_batches_apply_and_duplicates_are_ignored() -> None:
    indexer = KvIndexer()
    assert not indexer.apply_batch(batch("w", 1, BlockStored(blocks=[1, 2, 3])))
    assert not indexer.apply_batch(batch("w", 2, BlockRemoved(seq_hashes=[3])))
    assert not indexer.apply_batch(batch("w", 1, BlockStored(blocks=[1, 2, 3])))  # a duplicate
    assert indexer.find_matches([1, 2, 3]).blocks == {"w": 2}
    assert indexer.is_synced("w")
    assert not indexer.apply_batch(batch("w", 3, AllCleared()))
    assert indexer.find_matches([1]).blocks == {}


def test_a_cleared_tier_forgets_that_tier_alone_and_remote_for_every_worker() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch("a", 1, BlockStored(blocks=[1, 2]), BlockStored(blocks=[3], tier="host")))
    indexer.apply_batch(batch("b", 1, BlockStored(blocks=[1])))
    indexer.apply_batch(batch("a", 2, BlockStored(blocks=[8, 9], tier="remote")))
    assert indexer.blocks.blocks_of("b") == {"device": {1}, "remote": {8, 9}}
    indexer.apply_batch(batch("a", 3, AllCleared(tier="host")))
    assert indexer.blocks.blocks_of("a") == {"device": {1, 2}, "remote": {8, 9}}
    assert indexer.find_matches([1, 2, 3]).blocks == {"a": 2, "b": 1}
    # One worker's store lost track of the shared tier: no worker is credited with it.
    indexer.apply_batch(batch("a", 4, AllCleared(tier="remote")))
    assert indexer.blocks.blocks_of("a") == {"device": {1, 2}}
    assert indexer.blocks.blocks_of("b") == {"device": {1}}
    assert indexer.find_matches([8]).blocks == {}


def test_gap_asks_for_snapshot_and_held_back_batches_follow_it() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch("w", 1, BlockStored(blocks=[1])))
    # batch 2 is lost; 3 and 4 arrive: the indexer keeps its old view and asks for a resync
    assert indexer.apply_batch(batch("w", 3, BlockStored(blocks=[5])))
    assert indexer.apply_batch(batch("w", 4, BlockStored(blocks=[6])))
    assert indexer.needs_resync() == ["w"]
    assert indexer.find_matches([1]).blocks == {"w": 1}
    # the snapshot is as of batch 3 (it includes block 5); batch 4 is replayed after it
    gap_left = indexer.apply_snapshot(KvSnapshot(worker_id="w", event_id=3, blocks={"device": [1, 2, 5]}))
    assert not gap_left
    assert indexer.is_synced("w")
    assert indexer.find_matches([1, 2]).blocks == {"w": 2}
    assert indexer.find_matches([6]).blocks == {"w": 1}


def test_unknown_worker_needs_a_snapshot_unless_it_starts_at_batch_one() -> None:
    indexer = KvIndexer()
    indexer.add_worker("old")  # router start: the worker has been running a while
    assert indexer.needs_resync() == ["old"]
    assert indexer.apply_batch(batch("old", 17, BlockStored(blocks=[4])))
    assert not indexer.apply_snapshot(KvSnapshot(worker_id="old", event_id=16, blocks={"device": [3]}))
    assert indexer.find_matches([3]).blocks == {"old": 1}
    assert indexer.find_matches([4]).blocks == {"old": 1}
    assert not indexer.apply_batch(batch("new", 1, BlockStored(blocks=[8])))
    assert indexer.needs_resync() == []


def test_stale_snapshot_is_ignored() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch("w", 1, BlockStored(blocks=[1])))
    indexer.apply_batch(batch("w", 2, BlockStored(blocks=[2])))
    assert not indexer.apply_snapshot(KvSnapshot(worker_id="w", event_id=1, blocks={"device": [1]}))
    assert indexer.blocks.blocks_of("w") == {"device": {1, 2}}


# ---------------------------------------------------------------------------- property

HASHES = st.integers(min_value=1, max_value=40)
TIER = st.sampled_from(["device", "device", "host", "disk"])
SOME = st.lists(HASHES, min_size=1, max_size=6)
EVENT = st.one_of(
    st.builds(lambda b, t: BlockStored(blocks=b, tier=t), SOME, TIER),
    st.builds(lambda b, t: BlockRemoved(seq_hashes=b, tier=t), SOME, TIER),
    st.just(AllCleared()),
    st.builds(lambda t: AllCleared(tier=t), TIER),
)


class _Worker:
    """A worker publishing batches; its true state is what a clean replay produces."""

    def __init__(self, worker_id: str, events: list[list[KvEvent]]) -> None:
        self.worker_id = worker_id
        self.batches = [batch(worker_id, i + 1, *evs) for i, evs in enumerate(events)]
        self.published = 0

    def state_after(self, n: int) -> dict[str, set[int]]:
        clean = KvIndexer()
        clean.add_worker(self.worker_id)
        for b in self.batches[:n]:
            clean.apply_batch(b)
        return clean.blocks.blocks_of(self.worker_id)

    def snapshot(self) -> KvSnapshot:
        blocks = {tier: sorted(h) for tier, h in self.state_after(self.published).items()}
        return KvSnapshot(worker_id=self.worker_id, event_id=self.published, blocks=blocks)


@settings(max_examples=100, deadline=None)
@given(
    events=st.lists(st.lists(st.lists(EVENT, min_size=1, max_size=3), max_size=12), min_size=1, max_size=3),
    data=st.data(),
)
def test_any_delivery_order_with_losses_recovers_the_clean_state(
    events: list[list[list[KvEvent]]], data: st.DataObject
) -> None:
    workers = [_Worker(f"w{i}", evs) for i, evs in enumerate(events)]
    indexer = KvIndexer()
    for w in workers:
        indexer.add_worker(w.worker_id)  # the router starts while the workers run
    in_transit: list[KvEventBatch] = []
    by_id = {w.worker_id: w for w in workers}
    for _ in range(data.draw(st.integers(0, 60))):
        action = data.draw(st.sampled_from(["publish", "deliver", "drop", "duplicate", "resync"]))
        if action == "publish":
            w = data.draw(st.sampled_from(workers))
            if w.published < len(w.batches):
                in_transit.append(w.batches[w.published])
                w.published += 1
        elif action in ("deliver", "drop", "duplicate") and in_transit:
            i = data.draw(st.integers(0, len(in_transit) - 1))
            if action == "duplicate":
                indexer.apply_batch(in_transit[i])
            else:
                b = in_transit.pop(i)
                if action == "deliver":
                    indexer.apply_batch(b)
        elif action == "resync" and indexer.needs_resync():
            worker_id = data.draw(st.sampled_from(indexer.needs_resync()))
            indexer.apply_snapshot(by_id[worker_id].snapshot())
    # Everything still in flight arrives in some order, then resyncs settle any gap.
    for w in workers:
        in_transit.extend(w.batches[w.published :])
        w.published = len(w.batches)
    for b in data.draw(st.permutations(in_transit)):
        indexer.apply_batch(b)
    for w in workers:  # a load report names the last batch, exposing a lost final one
        indexer.observe_event_id(w.worker_id, w.published)
    for worker_id in indexer.needs_resync():
        assert not indexer.apply_snapshot(by_id[worker_id].snapshot())
    for w in workers:
        assert indexer.is_synced(w.worker_id)
        assert indexer.blocks.blocks_of(w.worker_id) == w.state_after(len(w.batches))
    # and the lookup agrees with a brute-force longest prefix over the true states
    probe = list(range(1, 41))
    expected: dict[str, int] = {}
    for w in workers:
        held = set().union(*w.state_after(len(w.batches)).values())
        depth = next((i for i, h in enumerate(probe) if h not in held), len(probe))
        if depth:
            expected[w.worker_id] = depth
    assert indexer.find_matches(probe).blocks == expected


def test_load_report_exposes_a_lost_final_batch() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch("w", 1, BlockStored(blocks=[1])))
    # batch 2 (storing block 2) is lost and nothing follows it: only the report tells
    assert not indexer.observe_event_id("w", 1)
    assert indexer.observe_event_id("w", 2)
    assert indexer.needs_resync() == ["w"]
    assert not indexer.apply_snapshot(KvSnapshot(worker_id="w", event_id=2, blocks={"device": [1, 2]}))
    assert indexer.find_matches([1, 2]).blocks == {"w": 2}


def test_in_flight_blocks_count_before_the_workers_events_show_them() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch("a", 1, BlockStored(blocks=[1, 2])))
    indexer.apply_batch(batch("b", 1, BlockStored(blocks=[1])))
    # b is prefilling a request of blocks 1..4 (its events will follow); c one of 7, 8.
    indexer.inflight = {"a": {}, "b": {1: 1, 2: 1, 3: 1, 4: 1}, "c": {7: 1, 8: 1}}
    assert indexer.find_matches([1, 2, 3, 9]).blocks == {"a": 2, "b": 3}
    assert indexer.find_matches([7, 8]).blocks == {"c": 2}
    assert indexer.find_matches([5]).blocks == {}
