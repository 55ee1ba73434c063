"""KVCacheManager (device only): prefix hits on the shared hash, ref counts, LRU eviction, KV events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.deepinfer.block_pool import EVICTIONS, Eviction
from backends.deepinfer.kv_cache_manager import KVCacheManager
from backends.deepinfer.sequence import Sequence
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import AllCleared, BlockRemoved, BlockStored, KvEventBatch, WorkerRequest

BS = 4


def make_seq(
    tokens: list[int], rid: str = "r", salt: str | None = None, hashes: list[int] | None = None
) -> Sequence:
    request = WorkerRequest(
        request_id=rid, token_ids=tokens, max_tokens=8, cache_salt=salt, block_hashes=hashes or []
    )
    return Sequence(request)


def prefill(bm: KVCacheManager, seq: Sequence) -> int:
    """Admit `seq` with its prefix hits and compute all its tokens, as one engine step would."""
    prefix = bm.match_prefix(seq)
    n = len(seq) - len(prefix) * BS
    assert bm.can_allocate(seq, n, prefix)
    bm.allocate(seq, n, prefix)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)
    return len(prefix)


def apply(batches: list[KvEventBatch], index: set[int]) -> None:
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                index.update(event.blocks)
            elif isinstance(event, BlockRemoved):
                index.difference_update(event.seq_hashes)
            elif isinstance(event, AllCleared):
                index.clear()


def test_prefix_hit_shares_blocks_and_counts_cached_tokens() -> None:
    bm = KVCacheManager(16, BS)
    a = make_seq(list(range(10)), "a")
    assert prefill(bm, a) == 0
    b = make_seq([*range(10), 99], "b")
    assert prefill(bm, b) == 2  # the two full blocks of the shared 10-token prefix
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 8
    assert [bm.pool.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.num_active_blocks == 4


def test_hashes_follow_the_shared_contract_and_the_salt() -> None:
    bm = KVCacheManager(16, BS)
    tokens = list(range(12))
    a = make_seq(tokens, "a")
    prefill(bm, a)
    assert a.block_hashes == block_hashes(tokens, BS)
    salted = make_seq(tokens, "s", salt="tenant-1")
    assert prefill(bm, salted) == 0
    assert salted.block_hashes == block_hashes(tokens, BS, salt="tenant-1")


def test_given_hashes_are_used_not_recomputed() -> None:
    bm = KVCacheManager(16, BS)
    a = make_seq(list(range(8)), "a", hashes=[111, 222])
    prefill(bm, a)
    stored = bm.take_events()[0].events[0]
    assert isinstance(stored, BlockStored) and stored.blocks == [111, 222]


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    bm = KVCacheManager(16, BS)
    prefill(bm, make_seq(list(range(8)), "a"))
    b = make_seq(list(range(8)), "b")
    assert len(bm.match_prefix(b)) == 1  # block 2 is recomputed to get the logits of token 8


def test_generated_tokens_extend_the_hash_chain_incrementally() -> None:
    bm = KVCacheManager(16, BS)
    seq = make_seq(list(range(6)), "a")
    prefill(bm, seq)
    bm.take_events()
    for token in (50, 51, 52):  # the second block fills at token 8; its KV exists one step later
        seq.token_ids.append(token)
        bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        bm.cache_full_blocks(seq)
    assert seq.block_hashes == block_hashes(seq.token_ids, BS)
    (batch,) = bm.take_events()
    assert batch.events == [BlockStored(blocks=[seq.block_hashes[1]], parent_seq_hash=seq.block_hashes[0])]


def test_deallocate_keeps_cached_blocks_until_evicted_lru_tail_first() -> None:
    bm = KVCacheManager(6, BS)
    a = make_seq([*range(8), 1000], "a")  # blocks: A0 A1 + partial
    b = make_seq([*range(100, 108), 1000], "b")  # B0 B1 + partial
    prefill(bm, a)
    prefill(bm, b)
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_active_blocks == 0 and bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    bm.take_events()
    # Four fresh blocks: the two uncached partial blocks, then A1 and A0 (A freed first, tail first).
    c = make_seq(list(range(200, 216)), "c")
    prefill(bm, c)
    removed = [e for batch in bm.take_events() for e in batch.events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(seq_hashes=[a.block_hashes[1], a.block_hashes[0]])]
    # B's prefix is still cached and hit.
    assert len(bm.match_prefix(make_seq([*range(100, 108), 7], "b2"))) == 2


def test_segmented_lru_keeps_reused_blocks_through_one_off_prompts() -> None:
    """A prefix reused once is protected: the one-off prompts after it evict each other
    instead, under slru; under lru they evict the prefix."""
    survivors = {}
    for eviction in ("lru", "slru", "arc"):
        bm = KVCacheManager(10, BS, eviction=eviction)
        shared = list(range(8))  # two full blocks
        for rid in ("a", "b"):  # b's prefix hit protects them
            seq = make_seq([*shared, 99], rid)
            prefill(bm, seq)
            bm.deallocate(seq)
        for i in range(4):  # 12 one-off blocks through a pool of 10
            seq = make_seq(list(range(100 * (i + 1), 100 * (i + 1) + 12)), f"once{i}")
            prefill(bm, seq)
            bm.deallocate(seq)
        survivors[eviction] = len(bm.match_prefix(make_seq([*shared, 7], "c")))
    assert survivors == {"lru": 0, "slru": 2, "arc": 2}


def test_adaptive_eviction_gives_room_to_the_blocks_that_come_back() -> None:
    """Eight blocks reused once, then never again, and a cycle of four one-off prompts through
    what is left of a pool of 10. Segmented LRU keeps the eight and the cycle never hits; ARC
    sees the cycle's evicted blocks come back, grows the unprotected target, and lets the
    stale protected blocks go instead."""
    last_lap = {}
    for eviction in ("slru", "arc"):
        bm = KVCacheManager(10, BS, eviction=eviction)
        for p in range(8):
            for rid in ("first", "again"):  # the second sees a hit: protected
                seq = make_seq([*range(100 * p, 100 * p + BS), 9], f"{rid}{p}")
                prefill(bm, seq)
                bm.deallocate(seq)
        for lap in range(4):
            last_lap[eviction] = 0
            for x in range(4):
                seq = make_seq([*range(10_000 * (x + 1), 10_000 * (x + 1) + BS), 9], f"lap{lap}x{x}")
                last_lap[eviction] += len(bm.match_prefix(seq))
                prefill(bm, seq)
                bm.deallocate(seq)
    assert last_lap == {"slru": 0, "arc": 4}


def test_segmented_lru_protects_at_most_its_share_demoting_the_least_recent() -> None:
    bm = KVCacheManager(10, BS, eviction="slru")  # protects at most int(10 * 0.8) = 8 blocks
    prefixes = [[100 * p + t for t in range(BS)] for p in range(9)]  # one full block each
    for p, tokens in enumerate(prefixes):
        for rid in ("first", "again"):  # the second hit sends the block to the protected share
            seq = make_seq([*tokens, 9], f"{rid}{p}")
            prefill(bm, seq)
            bm.deallocate(seq)
    assert bm.num_cached_blocks == 9 and sum(block.protected for block in bm.pool.blocks) == 8
    # Prefix 0, the least recently freed of the protected, went back to the unprotected ones
    # when prefix 8 was reused: the one block evicted for a new prompt is prefix 0's.
    bm.take_events()
    prefill(bm, make_seq(list(range(1000, 1008)), "new"))
    removed = [e for batch in bm.take_events() for e in batch.events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(seq_hashes=block_hashes(prefixes[0], BS))]


def test_can_allocate_counts_free_prefix_hits_against_the_pool() -> None:
    bm = KVCacheManager(3, BS)
    a = make_seq([*range(8), 1], "a")
    prefill(bm, a)
    bm.deallocate(a)
    b = make_seq(list(range(8)) + list(range(50, 54)), "b")
    prefix = bm.match_prefix(b)
    assert len(prefix) == 2
    assert bm.can_allocate(b, 4, prefix)  # 2 reused + 1 new = 3 blocks
    assert not bm.can_allocate(b, 5, prefix)  # would need a fourth


def test_event_batches_are_numbered_and_snapshot_seals_pending_events() -> None:
    bm = KVCacheManager(8, BS)
    prefill(bm, make_seq(list(range(8)), "a"))
    (first,) = bm.take_events()
    assert first.event_id == 1 and first.worker_id == ""
    prefill(bm, make_seq(list(range(30, 38)), "b"))
    snap = bm.snapshot()
    assert snap.event_id == 2
    (second,) = bm.take_events()
    assert second.event_id == 2
    assert bm.take_events() == []
    bm.clear_cache()
    (third,) = bm.take_events()
    assert third.event_id == 3 and third.events == [AllCleared(tier="device")]
    assert bm.snapshot().blocks == {"device": []}


def test_prefix_caching_off_never_hits_nor_emits() -> None:
    bm = KVCacheManager(8, BS, enable_prefix_caching=False)
    prefill(bm, make_seq(list(range(8)), "a"))
    assert prefill(bm, make_seq([*range(8), 1], "b")) == 0
    assert bm.take_events() == []


@pytest.mark.parametrize("eviction", EVICTIONS)
@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),  # which of four shared prefixes
            st.integers(1, 14),  # prompt length
            st.integers(0, 2),  # 0: keep running, else free at once
        ),
        min_size=1,
        max_size=25,
    )
)
def test_events_reproduce_the_snapshot_and_counts_stay_exact(
    eviction: Eviction, ops: list[tuple[int, int, int]]
) -> None:
    bm = KVCacheManager(10, BS, eviction=eviction)
    live: list[Sequence] = []
    index: set[int] = set()
    for i, (prefix_id, length, free_now) in enumerate(ops):
        seq = make_seq([prefix_id * 100 + t for t in range(length)], f"r{i}")
        prefix = bm.match_prefix(seq)
        n = len(seq) - len(prefix) * BS
        while not bm.can_allocate(seq, n, prefix) and live:
            bm.deallocate(live.pop(0))
            prefix = bm.match_prefix(seq)
            n = len(seq) - len(prefix) * BS
        if not bm.can_allocate(seq, n, prefix):
            continue
        bm.allocate(seq, n, prefix)
        seq.num_computed_tokens = len(seq)
        bm.cache_full_blocks(seq)
        if free_now:
            bm.deallocate(seq)
        else:
            live.append(seq)
        if i % 3 == 0:
            apply(bm.take_events(), index)
        # Ref counts equal the block tables' claims; every block is active or free.
        claims = [0] * bm.num_blocks
        for s in live:
            for block_id in s.block_table:
                claims[block_id] += 1
        assert claims == [b.ref_count for b in bm.pool.blocks]
        assert bm.num_active_blocks + bm.num_free_blocks == bm.num_blocks
        assert bm.num_active_blocks == sum(1 for c in claims if c)
    snap = bm.snapshot()
    apply(bm.take_events(), index)
    assert index == set(snap.blocks["device"])
    assert index == {b.seq_hash for b in bm.pool.blocks if b.seq_hash is not None}
