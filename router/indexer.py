"""The KV indexer: which workers cache which blocks, kept current from workers' KV events.

Each worker numbers its event batches 1, 2, 3, ... A batch whose id is not the next one
means a batch was lost (or overtook another): the indexer keeps routing on what it has,
holds the early batch back and asks for a resync. A snapshot replaces the worker's part of
the index as of the snapshot's event id; held-back batches after it are then applied in
order. A worker never seen before (router start, worker join) also needs a snapshot, unless
its first batch is batch 1: it is new, and its events from the start are its whole state.

Events lag decisions: a worker stores a prompt's blocks once it has prefilled them and
publishes them up to one publish interval later, so a prompt repeated right after the first
would find no worker holding it. A match therefore also counts, past what a worker's events
show, the blocks of requests routed to it and not yet finished (`inflight`, the router's
own bookkeeping): they are there, or being computed there, until the request ends, and by
then its events have long said so (or, for an engine that cached nothing, say nothing).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from orchestrator.runtime.protocol import AllCleared, BlockRemoved, BlockStored, KvEventBatch, KvSnapshot
from router.block_index import TIERS, BlockIndex, Matches

MAX_HELD_BACK = 4096  # batches kept per worker while a snapshot is awaited


@dataclass(slots=True)
class _SyncState:
    last_event_id: int | None = None  # None: never synced
    published: int = 0  # the highest event id the worker is known to have published
    held_back: dict[int, KvEventBatch] = field(default_factory=dict)


class KvIndexer:
    def __init__(self) -> None:
        self.blocks = BlockIndex()
        self._sync: dict[str, _SyncState] = {}
        # Workers whose state was never known: the router keeps requests off them until their
        # snapshot arrives, so a restarted router does not see warm workers as cold.
        self.joining: set[str] = set()
        self.events_applied = 0
        self.blocks_applied = 0
        # worker -> blocks of its in-flight requests; the Router shares its LoadTracker's.
        self.inflight: Mapping[str, Collection[int]] = {}

    # ------------------------------------------------------------------ workers

    def add_worker(self, worker_id: str) -> None:
        if worker_id not in self._sync:
            self._sync[worker_id] = _SyncState()
            self.joining.add(worker_id)
        self.blocks.add_worker(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        self._sync.pop(worker_id, None)
        self.joining.discard(worker_id)
        self.blocks.remove_worker(worker_id)

    def needs_resync(self) -> list[str]:
        """Workers whose state is unknown or has a gap: fetch their snapshots."""
        return [w for w, s in self._sync.items() if _has_gap(s)]

    def was_synced(self, worker_id: str) -> bool:
        """Whether the worker's state was ever known (a resync now repairs a gap, not a join)."""
        state = self._sync.get(worker_id)
        return state is not None and state.last_event_id is not None

    def is_synced(self, worker_id: str) -> bool:
        state = self._sync.get(worker_id)
        return state is not None and not _has_gap(state)

    # ------------------------------------------------------------------ events

    def apply_batch(self, batch: KvEventBatch) -> bool:
        """Apply one batch; True when the worker now needs a snapshot (a gap was seen)."""
        state = self._sync.get(batch.worker_id)
        if state is None:
            self.add_worker(batch.worker_id)
            state = self._sync[batch.worker_id]
        last = state.last_event_id
        if last is None and batch.event_id == 1:
            last = 0
        if last is not None and batch.event_id <= last:
            return False  # already covered by a snapshot or applied: a duplicate
        if last is not None and batch.event_id == last + 1:
            self._apply(batch)
            state.last_event_id = batch.event_id
            self.joining.discard(batch.worker_id)
            self._drain_held_back(state)
            return _has_gap(state)
        if len(state.held_back) >= MAX_HELD_BACK:
            state.held_back.pop(min(state.held_back))
        state.held_back[batch.event_id] = batch
        return True

    def observe_event_id(self, worker_id: str, event_id: int) -> bool:
        """The worker says it has published up to `event_id` (its load reports carry it):
        True when that reveals a lost batch, which for the last one no later batch would."""
        state = self._sync.get(worker_id)
        if state is None:
            return False
        state.published = max(state.published, event_id)
        return _has_gap(state)

    def apply_snapshot(self, snapshot: KvSnapshot) -> bool:
        """Replace a worker's blocks with its snapshot; True if a gap remains after it."""
        state = self._sync.get(snapshot.worker_id)
        if state is None:
            self.add_worker(snapshot.worker_id)
            state = self._sync[snapshot.worker_id]
        if state.last_event_id is None or snapshot.event_id > state.last_event_id:
            self.blocks.clear_worker(snapshot.worker_id)
            for tier in TIERS:
                self.blocks.store(snapshot.worker_id, snapshot.blocks.get(tier, ()), tier)
            state.last_event_id = snapshot.event_id
            self.joining.discard(snapshot.worker_id)
        for event_id in [i for i in state.held_back if i <= state.last_event_id]:
            del state.held_back[event_id]
        self._drain_held_back(state)
        return _has_gap(state)

    def _drain_held_back(self, state: _SyncState) -> None:
        assert state.last_event_id is not None
        while (batch := state.held_back.pop(state.last_event_id + 1, None)) is not None:
            self._apply(batch)
            state.last_event_id = batch.event_id

    def _apply(self, batch: KvEventBatch) -> None:
        worker_id = batch.worker_id
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.blocks.store(worker_id, event.blocks, event.tier)
                self.blocks_applied += len(event.blocks)
            elif isinstance(event, BlockRemoved):
                self.blocks.remove(worker_id, event.seq_hashes, event.tier)
                self.blocks_applied += len(event.seq_hashes)
            elif isinstance(event, AllCleared):
                if event.tier is None:
                    self.blocks.clear_worker(worker_id)
                else:
                    self.blocks.clear_tier(worker_id, event.tier)
        self.events_applied += len(batch.events)

    # ------------------------------------------------------------------ lookups

    def find_matches(self, hashes: Sequence[int]) -> Matches:
        matches = self.blocks.find_matches(hashes)
        if not hashes:
            return matches
        first, blocks, n = hashes[0], matches.blocks, len(hashes)
        for worker_id, held in self.inflight.items():
            # A request's held blocks run from its first, so a prompt sharing none of them
            # is answered by one lookup.
            if first not in held:
                continue
            depth = blocks.get(worker_id, 0)
            while depth < n and hashes[depth] in held:
                depth += 1
            if depth:
                blocks[worker_id] = depth
        return matches

    def on_routed(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Events, not decisions, tell this index what workers cache."""


def _has_gap(state: _SyncState) -> bool:
    last = state.last_event_id
    return last is None or bool(state.held_back) or state.published > last
