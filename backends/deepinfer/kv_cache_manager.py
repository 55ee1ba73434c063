"""Prefix caching over the device's block pool, the tiers below it, and the KV events both make.

A block enters the prefix cache (hash -> block) once its tokens' KV has been computed
(`cache_full_blocks`, called after each step), never at allocation, so a later request can
never hit a block whose KV is still being written. With tiers (kvbm.TieredStore) the same
blocks are then written through to them (`take_saves`, the engine copies their bytes out after
the step), and a prefix walk that runs off the device's cache continues in the tiers: the
blocks found there get fresh device blocks, enter the prefix cache at once, and are written
into the device (`take_loads`) before the next forward, the only thing that reads them.

Lower-tier payloads are read when the sequence is matched, before the step: from host memory
at once, from disk or a remote store on the tiers' transfer thread while the sequence waits
(`Prefix.waiting`; the scheduler sets it aside as LOADING_KV). A block a tier cannot return
intact is simply not part of the prefix and is recomputed.

Disaggregation uses the same path from both ends. A prefill-only sequence's prompt blocks
are held when it finishes (`hold`), referenced so that no eviction reuses them, until the
decode worker has pulled them or gave up (`release`): its full blocks, and its last, partial
block named by `tail_hash`. A decode sequence arrives with those blocks (`Sequence.arrived`);
the walk takes them after the device's own blocks, as loads like a tier's, the partial block
last and uncached (it is still being filled), and recomputes whatever did not arrive. With
the whole prompt arrived, the decode's first step is a decode step, as it would have been on
the prefill worker.

Sliding-window attention: a block whose tokens all lie before the window of the sequence's
next token can never be attended again by it, so `release_outside_window` gives it back after
each step (its place in the block table becomes `NULL_BLOCK`): a sequence holds about
window / block_size blocks however long it grows. A released full block stays in the prefix
cache until evicted, so another request may still start from it, and a prefix whose first
blocks were evicted resumes from the blocks its window needs alone (`_match_window`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.deepinfer.block_pool import Block, BlockPool, Eviction
from backends.deepinfer.outputs import BlockLoad, LoadSource
from backends.deepinfer.sequence import Sequence
from kvbm.records import Payload
from kvbm.tiered import Fetch, Fetched, TieredStore
from orchestrator.runtime.hashing import block_hashes, tail_hash
from orchestrator.runtime.protocol import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvSnapshot,
)

NULL_BLOCK = -1  # a block-table entry whose block slid out of the attention window


@dataclass(slots=True)
class Prefix:
    """A sequence's cached prefix: device blocks, then blocks to load from lower tiers.
    `waiting`: a slow tier is still reading more of it; admit the sequence later.
    `skipped`: leading blocks a sliding window makes unnecessary (`NULL_BLOCK` in the table)."""

    skipped: int = 0
    blocks: list[Block] = field(default_factory=list)
    arrived: list[tuple[int, Payload]] = field(default_factory=list)  # (seq_hash, payload) from a prefill
    loads: list[Fetched] = field(default_factory=list)
    # The prompt's partial last block from a prefill: its payload and how many tokens it holds.
    tail: tuple[Payload, int] | None = None
    waiting: bool = False

    def __len__(self) -> int:
        """Blocks, the partial and skipped ones included."""
        return self.skipped + len(self.blocks) + len(self.arrived) + len(self.loads) + (self.tail is not None)

    def num_tokens(self, block_size: int) -> int:
        full = self.skipped + len(self.blocks) + len(self.arrived) + len(self.loads)
        return full * block_size + (self.tail[1] if self.tail is not None else 0)

    @property
    def num_to_load(self) -> int:
        return len(self.arrived) + len(self.loads) + (self.tail is not None)


@dataclass(slots=True)
class Held:
    """A finished prefill-only sequence's blocks kept for a decode worker: (block_id, name)
    in prefix order, the names its block hashes and, when `tail_tokens`, the last one the
    `tail_hash` of a partial block of that many tokens."""

    blocks: list[tuple[int, int]] = field(default_factory=list)
    tail_tokens: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        tiers: TieredStore | None = None,
        sliding_window: int | None = None,
        eviction: Eviction = "lru",
    ) -> None:
        self.pool = BlockPool(num_blocks, eviction)
        self.sliding_window = sliding_window  # the model's, when every layer attends within one
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tiers = tiers if enable_prefix_caching else None
        self._events: list[KvEvent] = []  # not yet sealed into a batch
        self._batches: list[KvEventBatch] = []
        self._event_id = 0
        self._loads: list[BlockLoad] = []  # to write into the device before the next forward
        self._saves: list[tuple[int, int]] = []  # (block_id, seq_hash) to write through after it

    # ------------------------------------------------------------------ counters

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_active_blocks(self) -> int:
        return self.pool.num_active_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.pool.cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return self.pool.num_active_blocks / self.num_blocks

    # ------------------------------------------------------------------ allocation

    def match_prefix(self, seq: Sequence) -> Prefix:
        """The cached blocks covering the longest prefix of `seq`, without taking them.

        At least one token is left to compute: the step that computes it yields the logits."""
        if not self.enable_prefix_caching:
            return Prefix()
        n_full = (len(seq) - 1) // self.block_size
        self._hash_blocks(seq, n_full)
        prefix = Prefix()
        cached = self.pool.cached
        hashes = seq.block_hashes
        for h in hashes[:n_full]:
            block = cached.get(h)
            if block is None:
                break
            prefix.blocks.append(block)
        if (
            self.sliding_window is not None
            and len(prefix.blocks) < n_full
            and self.tiers is None
            and not seq.arrived
        ):
            self._match_window(prefix, hashes[:n_full])
        if seq.arrived:
            arrived = seq.arrived
            for h in hashes[len(prefix.blocks) : n_full]:
                payload = arrived.get(h)
                if payload is None:
                    break
                prefix.arrived.append((h, payload))
            prefix.tail = self._arrived_tail(seq, len(prefix.blocks) + len(prefix.arrived))
        found = len(prefix.blocks) + len(prefix.arrived)
        if self.tiers is not None and found < n_full:
            prefix.loads, prefix.waiting = self.tiers.fetch_prefix(hashes[found:n_full], seq.fetch)
        return prefix

    def _match_window(self, prefix: Prefix, hashes: list[int]) -> None:
        """With a sliding window, a prefix of P blocks can be resumed from its last blocks
        alone: those the window of token P * block_size reaches. So where the walk from the
        first block stopped short, take the longest such P whose window blocks are all cached
        (the blocks before them evicted, say): the recompute is then bounded by what is missing
        of the window, not by the whole prefix."""
        assert self.sliding_window is not None
        cached, bs, window = self.pool.cached, self.block_size, self.sliding_window
        for end in range(len(hashes), len(prefix.blocks), -1):
            first = max(0, (end * bs - window + 1) // bs)
            blocks = [cached.get(h) for h in hashes[first:end]]
            if all(b is not None for b in blocks):
                prefix.skipped, prefix.blocks = first, [b for b in blocks if b is not None]
                return

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: Prefix | None = None) -> bool:
        """Whether `seq` can get slots for `num_new_tokens` more tokens (after `prefix`, for a
        sequence without blocks). Prefix hits on free blocks take them off the free list too."""
        needed = self._blocks_needed(seq, num_new_tokens, prefix)
        if needed == 0 and not prefix:
            return True  # the common decode step: room left in the last block
        taken = (
            0 if prefix is None else sum(1 for b in prefix.blocks if b.ref_count == 0) + prefix.num_to_load
        )
        return needed + taken <= self.pool.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: Prefix | None = None) -> None:
        """Give `seq` slots for `num_new_tokens` more tokens; the caller checked can_allocate."""
        if not seq.block_table:  # admission (or resumption after preemption)
            if prefix:
                self._take_prefix(seq, prefix)
            seq.num_computed_tokens = prefix.num_tokens(self.block_size) if prefix else 0
            seq.num_registered_blocks = seq.num_computed_tokens // self.block_size
            if seq.num_completion_tokens == 0:  # a sequence resumed mid-decode keeps its figure
                seq.num_cached_tokens = seq.num_computed_tokens
        elif prefix:
            raise ValueError(f"{seq.request_id}: a prefix can only start an empty block table")
        needed = self._blocks_needed(seq, num_new_tokens)
        if needed:
            seq.block_table += self._take_free_ids(needed)

    def _take_prefix(self, seq: Sequence, prefix: Prefix) -> None:
        seq.block_table.extend([NULL_BLOCK] * prefix.skipped)
        for block in prefix.blocks:
            self.pool.ref(block)
            self.pool.reused(block)
            seq.block_table.append(block.block_id)
        seq.arrived = {}  # taken now, or not part of the prefix: recomputed either way
        if not prefix.num_to_load:
            return
        parent = seq.block_hashes[len(prefix.blocks) - 1] if prefix.blocks else None
        loads: list[tuple[int, LoadSource, Payload]] = [(h, "transfer", p) for h, p in prefix.arrived]
        loads += prefix.loads
        for seq_hash, source, payload in loads:
            block = self._take_free()
            self.pool.cache(block, seq_hash)
            seq.block_table.append(block.block_id)
            self._loads.append(BlockLoad(block.block_id, source, payload))
        if loads:
            self._events.append(
                BlockStored(blocks=[seq_hash for seq_hash, _, _ in loads], parent_seq_hash=parent)
            )
        if prefix.tail is not None:  # not cached: the decode fills the rest of it
            block = self._take_free()
            seq.block_table.append(block.block_id)
            self._loads.append(BlockLoad(block.block_id, "transfer", prefix.tail[0]))
        if prefix.loads:
            assert self.tiers is not None
            self.tiers.onboarded(prefix.loads)
            seq.fetch = Fetch()

    def deallocate(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks; it keeps its tokens and hashes (recompute on resume)."""
        # Tail first: a sequence's last blocks are the least likely to be shared, so they
        # should be the first evicted.
        table = seq.block_table
        self.pool.release_many(block_id for block_id in reversed(table) if block_id != NULL_BLOCK)
        table.clear()
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def hold(self, seq: Sequence) -> Held:
        """Keep `seq`'s computed prompt blocks referenced past its end, for a decode worker
        to pull: the full ones that entered the prefix cache and, when every full one did,
        the partial last one. Call before `deallocate`."""
        if not self.enable_prefix_caching:
            return Held()  # no hashes to name the blocks by: the decode worker computes the prompt
        bs, prompt = self.block_size, seq.num_prompt_tokens
        if NULL_BLOCK in seq.block_table:
            return Held()  # its prompt slid out of the window: the decode worker computes it
        n = min(seq.num_registered_blocks, prompt // bs)
        held = Held(list(zip(seq.block_table[:n], seq.block_hashes[:n], strict=True)))
        if n == prompt // bs and prompt % bs and seq.num_computed_tokens >= prompt:
            tail = tail_hash(seq.token_ids[:prompt], bs, seq.request.cache_salt)
            assert tail is not None
            held.blocks.append((seq.block_table[n], tail))
            held.tail_tokens = prompt % bs
        self.retain(held)
        return held

    def release_outside_window(self, seq: Sequence) -> None:
        """Give back `seq`'s blocks that its next token's window (`sliding_window` keys, itself
        the last) has passed, and those of every later token: they lie before position
        num_computed_tokens - sliding_window + 1."""
        window = self.sliding_window
        assert window is not None
        table, bs = seq.block_table, self.block_size
        end = min((seq.num_computed_tokens - window + 1) // bs, len(table))
        # Released ones form a prefix of the table: walk back to its end, then release forward,
        # so the oldest blocks are the first the pool evicts (the least likely to be resumed).
        start = end
        while start > 0 and table[start - 1] != NULL_BLOCK:
            start -= 1
        self.pool.release_many(table[start:end])
        table[start:end] = [NULL_BLOCK] * (end - start)

    def retain(self, held: Held) -> None:
        """One more reference on held blocks (a reader copying them out)."""
        for block_id, _ in held.blocks:
            self.pool.ref(self.pool.blocks[block_id])

    def release(self, held: Held) -> None:
        """Drop the references `hold` took; full blocks stay cached until evicted."""
        self.pool.release_many(block_id for block_id, _ in held.blocks)

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
        cached = self.pool.cached
        run: list[int] = []  # consecutive newly stored hashes: one BlockStored event
        run_parent = hashes[first - 1] if first else None
        for i in range(first, n_full):
            h = hashes[i]
            if h in cached:  # another sequence computed the same block first; keep theirs
                if run:
                    self._events.append(BlockStored(blocks=run, parent_seq_hash=run_parent))
                    run = []
                run_parent = h
                continue
            block_id = seq.block_table[i]
            self.pool.cache(self.pool.blocks[block_id], h)
            run.append(h)
            if self.tiers is not None:
                self._saves.append((block_id, h))
        if run:
            self._events.append(BlockStored(blocks=run, parent_seq_hash=run_parent))

    def clear_cache(self) -> None:
        """Forget every cached hash on the device (blocks in use stay allocated, just
        uncached). The tiers below keep theirs, so the event clears the device tier only."""
        self.pool.clear()
        self._events.append(AllCleared(tier="device"))

    # ------------------------------------------------------------------ block moves

    def take_loads(self) -> list[BlockLoad]:
        """The blocks to write into the device before the next forward."""
        loads, self._loads = self._loads, []
        return loads

    def take_saves(self) -> list[tuple[int, int]]:
        """(block_id, seq_hash) computed by the last step, to copy out and offload."""
        saves, self._saves = self._saves, []
        return saves

    # ------------------------------------------------------------------ events

    def take_events(self) -> list[KvEventBatch]:
        """Drain the event batches produced since the last call, numbered 1, 2, 3, ..."""
        self._seal()
        batches, self._batches = self._batches, []
        return batches

    def snapshot(self) -> KvSnapshot:
        """Every cached block, per tier, exactly as of the returned event_id. Pending events
        are sealed into that batch first (it is still delivered by the next take_events)."""
        self._seal()
        blocks: dict[str, list[int]] = {"device": list(self.pool.cached)}
        if self.tiers is not None:
            blocks.update(self.tiers.snapshot().items())
        return KvSnapshot(worker_id="", event_id=self._event_id, blocks=blocks)

    def _seal(self) -> None:
        if self.tiers is not None:
            self._events.extend(self.tiers.take_events())
        if self._events:
            self._event_id += 1
            self._batches.append(KvEventBatch(worker_id="", event_id=self._event_id, events=self._events))
            self._events = []

    # ------------------------------------------------------------------ internals

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int, prefix: Prefix | None = None) -> int:
        prefix_tokens = prefix.num_tokens(self.block_size) if prefix else 0
        tokens = seq.num_computed_tokens + prefix_tokens + num_new_tokens
        prefix_blocks = len(prefix) if prefix else 0
        return max(0, -(-tokens // self.block_size) - len(seq.block_table) - prefix_blocks)

    def _arrived_tail(self, seq: Sequence, found: int) -> tuple[Payload, int] | None:
        """The prompt's partial last block, if it arrived and everything before it is there."""
        bs, prompt = self.block_size, seq.num_prompt_tokens
        if found != prompt // bs or not prompt % bs or len(seq) != prompt + 1:
            return None
        tail = tail_hash(seq.token_ids[:prompt], bs, seq.request.cache_salt)
        payload = seq.arrived.get(tail) if tail is not None else None
        return None if payload is None else (payload, prompt % bs)

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

    def _take_free(self) -> Block:
        return self.pool.blocks[self._take_free_ids(1)[0]]

    def _take_free_ids(self, n: int) -> list[int]:
        evicted: list[int] = []
        taken = self.pool.take_free_many(n, evicted)
        if evicted:
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockRemoved) and last.tier == "device":  # evictions in a row: one event
                last.seq_hashes += evicted
            else:
                self._events.append(BlockRemoved(seq_hashes=evicted))
        return taken
