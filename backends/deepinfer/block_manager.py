"""Paged KV blocks: reference counts, prefix caching on the shared sequence hash, LRU
eviction of free cached blocks, and the KV events that caching and eviction produce.

Blocks are integer ids; only the model runner maps them to KV memory, so nothing here
touches torch. A block enters the prefix cache (hash -> block) once its tokens' KV has been
computed (`cache_full_blocks`, called after each step), never at allocation, so a later
request can never hit a block whose KV is still being written. A cached block whose last
user leaves stays cached but free; it is reused by a prefix hit or evicted, least recently
freed first, when a fresh block is needed and no uncached free block is left.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

from backends.deepinfer.sequence import Sequence
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvSnapshot,
)


class Block:
    __slots__ = ("block_id", "ref_count", "seq_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.seq_hash: int | None = None  # set while the block is in the prefix cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._cached: dict[int, Block] = {}  # seq_hash -> the block holding it
        # Free blocks: uncached ones are handed out first (a stack), then cached ones in LRU order.
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, Block] = OrderedDict()
        self.num_active_blocks = 0  # blocks with ref_count > 0
        self._events: list[KvEvent] = []  # not yet sealed into a batch
        self._batches: list[KvEventBatch] = []
        self._event_id = 0

    # ------------------------------------------------------------------ counters

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return self.num_active_blocks / self.num_blocks

    # ------------------------------------------------------------------ allocation

    def match_prefix(self, seq: Sequence) -> list[Block]:
        """The cached blocks covering the longest prefix of `seq`, without taking them.

        At least one token is left to compute: the step that computes it yields the logits."""
        if not self.enable_prefix_caching:
            return []
        n_full = (len(seq) - 1) // self.block_size
        self._hash_blocks(seq, n_full)
        hits: list[Block] = []
        for h in seq.block_hashes[:n_full]:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: Seq[Block] = ()) -> bool:
        """Whether `seq` can get slots for `num_new_tokens` more tokens (after `prefix`, for a
        sequence without blocks). Prefix hits on free blocks take them off the free list too."""
        needed = self._blocks_needed(seq, num_new_tokens, len(prefix))
        if needed == 0 and not prefix:
            return True  # the common decode step: room left in the last block
        reused_free = sum(1 for b in prefix if b.ref_count == 0)
        return needed + reused_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: Seq[Block] = ()) -> None:
        """Give `seq` slots for `num_new_tokens` more tokens; the caller checked can_allocate."""
        if not seq.block_table:  # admission (or resumption after preemption)
            for block in prefix:
                self._ref(block)
            seq.block_table.extend(b.block_id for b in prefix)
            seq.num_computed_tokens = len(prefix) * self.block_size
            seq.num_registered_blocks = len(prefix)
            if seq.num_completion_tokens == 0:  # a sequence resumed mid-decode keeps its figure
                seq.num_cached_tokens = seq.num_computed_tokens
        elif prefix:
            raise ValueError(f"{seq.request_id}: a prefix can only start an empty block table")
        for _ in range(self._blocks_needed(seq, num_new_tokens, 0)):
            seq.block_table.append(self._take_free().block_id)

    def deallocate(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks; it keeps its tokens and hashes (recompute on resume)."""
        # Tail first: a sequence's last blocks are the least likely to be shared, so they
        # should be the first evicted.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.num_active_blocks -= 1
                if block.seq_hash is None:
                    self._free_uncached.append(block_id)
                else:
                    self._free_cached[block_id] = block
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Enter `seq`'s newly computed full blocks into the prefix cache; call after each step."""
        n_full = seq.num_computed_tokens // self.block_size
        first = seq.num_registered_blocks
        if n_full <= first:
            return
        seq.num_registered_blocks = n_full
        if not self.enable_prefix_caching:
            return
        self._hash_blocks(seq, n_full)
        hashes = seq.block_hashes
        run: list[int] = []  # consecutive newly stored hashes: one BlockStored event
        run_parent = hashes[first - 1] if first else None
        for i in range(first, n_full):
            h = hashes[i]
            if h in self._cached:  # another sequence computed the same block first; keep theirs
                if run:
                    self._events.append(BlockStored(blocks=run, parent_seq_hash=run_parent))
                    run = []
                run_parent = h
                continue
            block = self.blocks[seq.block_table[i]]
            block.seq_hash = h
            self._cached[h] = block
            run.append(h)
        if run:
            self._events.append(BlockStored(blocks=run, parent_seq_hash=run_parent))

    def clear_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated, just uncached)."""
        for block in self._cached.values():
            block.seq_hash = None
        self._free_uncached.extend(self._free_cached)
        self._free_cached.clear()
        self._cached.clear()
        self._events.append(AllCleared())

    # ------------------------------------------------------------------ events

    def take_events(self) -> list[KvEventBatch]:
        """Drain the event batches produced since the last call, numbered 1, 2, 3, ..."""
        self._seal()
        batches, self._batches = self._batches, []
        return batches

    def snapshot(self) -> KvSnapshot:
        """Every cached block, exactly as of the returned event_id. Pending events are sealed
        into that batch first (it is still delivered by the next take_events)."""
        self._seal()
        return KvSnapshot(worker_id="", event_id=self._event_id, blocks={"device": list(self._cached)})

    def _seal(self) -> None:
        if self._events:
            self._event_id += 1
            self._batches.append(KvEventBatch(worker_id="", event_id=self._event_id, events=self._events))
            self._events = []

    # ------------------------------------------------------------------ internals

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int, num_prefix_blocks: int) -> int:
        tokens = seq.num_computed_tokens + num_prefix_blocks * self.block_size + num_new_tokens
        return max(0, -(-tokens // self.block_size) - len(seq.block_table) - num_prefix_blocks)

    def _hash_blocks(self, seq: Sequence, n_full: int) -> None:
        """Extend seq.block_hashes to its first `n_full` blocks, hashing only the new ones."""
        have = len(seq.block_hashes)
        if have >= n_full:
            return
        bs = self.block_size
        parent = seq.block_hashes[-1] if have else None
        seq.block_hashes += block_hashes(
            seq.token_ids[have * bs : n_full * bs], bs, salt=seq.request.cache_salt, parent=parent
        )

    def _ref(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free_cached[block.block_id]  # a cached block with no user is always there
            self.num_active_blocks += 1
        block.ref_count += 1

    def _take_free(self) -> Block:
        if self._free_uncached:
            block = self.blocks[self._free_uncached.pop()]
        else:
            _, block = self._free_cached.popitem(last=False)
            self._evict(block)
        block.ref_count = 1
        self.num_active_blocks += 1
        return block

    def _evict(self, block: Block) -> None:
        assert block.seq_hash is not None
        del self._cached[block.seq_hash]
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):  # evictions in a row travel as one event
            last.seq_hashes.append(block.seq_hash)
        else:
            self._events.append(BlockRemoved(seq_hashes=[block.seq_hash]))
        block.seq_hash = None
