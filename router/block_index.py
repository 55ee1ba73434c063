"""A flat map from sequence hash to the workers that cache the block, per tier.

A sequence hash names a block together with its whole prefix, so no tree is needed: a
worker's longest cached prefix of a request is how far along the request's hashes the
worker keeps appearing. Each worker gets a slot (a bit position); each hash maps to an int
bitmask of slots, so one dict lookup and one AND per request block answer for all workers
at once, and the walk stops as soon as no worker matches any more.

A block a worker holds below the device (host, disk, remote) but not on it also sets its
bit in the map of the fastest tier that holds it (`_below`), so the walk can count each
worker's hits per tier: the router credits a host hit more than a remote one. Those maps are
empty unless a KVBM publishes lower-tier events, and the common device-only path never
touches them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from orchestrator.runtime.protocol import Tier

TIERS: tuple[Tier, ...] = ("device", "host", "disk", "remote")  # fastest first
LOWER_TIERS = TIERS[1:]


@dataclass(slots=True)
class Matches:
    """Per worker: cached prefix length in blocks, and how many of those it holds only below
    the device, by the fastest tier that holds each. Workers with no match are absent."""

    blocks: dict[str, int] = field(default_factory=dict)
    lower: dict[str, dict[Tier, int]] = field(default_factory=dict)


class _WorkerBlocks:
    __slots__ = ("lower_count", "slot", "tiers")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.tiers: dict[str, set[int]] = {tier: set() for tier in TIERS}
        self.lower_count = 0  # blocks held in lower tiers; 0 keeps the fast paths on

    def fastest_lower(self, seq_hash: int) -> Tier | None:
        """The fastest tier below the device that holds `seq_hash`, if any does."""
        for tier in LOWER_TIERS:
            if seq_hash in self.tiers[tier]:
                return tier
        return None


class BlockIndex:
    def __init__(self) -> None:
        self._workers: dict[str, _WorkerBlocks] = {}
        self._slot_ids: list[str | None] = []
        self._free_slots: list[int] = []
        self._any: dict[int, int] = {}  # seq hash -> slots holding it in any tier
        # tier -> seq hash -> slots holding it below the device, with this as the fastest tier
        self._below: dict[Tier, dict[int, int]] = {tier: {} for tier in LOWER_TIERS}

    # ------------------------------------------------------------------ workers

    def add_worker(self, worker_id: str) -> None:
        if worker_id in self._workers:
            return
        if self._free_slots:
            slot = self._free_slots.pop()
            self._slot_ids[slot] = worker_id
        else:
            slot = len(self._slot_ids)
            self._slot_ids.append(worker_id)
        self._workers[worker_id] = _WorkerBlocks(slot)

    def remove_worker(self, worker_id: str) -> None:
        if worker_id not in self._workers:
            return
        self.clear_worker(worker_id)
        slot = self._workers.pop(worker_id).slot
        self._slot_ids[slot] = None
        self._free_slots.append(slot)

    def clear_worker(self, worker_id: str) -> None:
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        keep = ~(1 << worker.slot)
        for maps in (self._any, *self._below.values()):
            for tier_blocks in worker.tiers.values():
                for seq_hash in tier_blocks:
                    mask = maps.get(seq_hash)
                    if mask is None:
                        continue
                    if mask & keep:
                        maps[seq_hash] = mask & keep
                    else:
                        del maps[seq_hash]
        for tier_blocks in worker.tiers.values():
            tier_blocks.clear()
        worker.lower_count = 0

    def clear_tier(self, worker_id: str, tier: Tier) -> None:
        """Forget what one tier of a worker holds: of every worker, for the shared remote tier
        (`remove` applies a remote removal to all of them)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        holders = self._workers.values() if tier == "remote" else [worker]
        self.remove(worker_id, set().union(*(w.tiers[tier] for w in holders)), tier)

    def workers(self) -> list[str]:
        return list(self._workers)

    # ------------------------------------------------------------------ blocks

    def store(self, worker_id: str, blocks: Collection[int], tier: Tier = "device") -> None:
        self.add_worker(worker_id)
        if tier == "remote":
            # One remote store serves every worker of the model: a block any of them put
            # there, each of them can load.
            for other in list(self._workers):
                self._store(other, blocks, tier)
            return
        self._store(worker_id, blocks, tier)

    def _store(self, worker_id: str, blocks: Collection[int], tier: Tier) -> None:
        worker = self._workers[worker_id]
        if tier == "device" and worker.lower_count == 0:
            bit = 1 << worker.slot
            any_ = self._any
            get = any_.get
            for seq_hash in blocks:
                any_[seq_hash] = get(seq_hash, 0) | bit
            worker.tiers["device"].update(blocks)
            return
        for seq_hash in blocks:
            held = worker.tiers[tier]
            if seq_hash not in held:
                held.add(seq_hash)
                worker.lower_count += tier != "device"
            self._refresh(worker, seq_hash)

    def remove(self, worker_id: str, blocks: Collection[int], tier: Tier = "device") -> None:
        if tier == "remote":  # gone from the shared store: gone for every worker
            for other in list(self._workers):
                self._remove(other, blocks, tier)
            return
        self._remove(worker_id, blocks, tier)

    def _remove(self, worker_id: str, blocks: Collection[int], tier: Tier) -> None:
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        if tier == "device" and worker.lower_count == 0:
            keep = ~(1 << worker.slot)
            any_ = self._any
            held = worker.tiers["device"]
            for seq_hash in blocks:
                if seq_hash in held:
                    held.discard(seq_hash)
                    mask = any_[seq_hash] & keep
                    if mask:
                        any_[seq_hash] = mask
                    else:
                        del any_[seq_hash]
            return
        for seq_hash in blocks:
            held = worker.tiers[tier]
            if seq_hash in held:
                held.discard(seq_hash)
                worker.lower_count -= tier != "device"
                self._refresh(worker, seq_hash)

    def _refresh(self, worker: _WorkerBlocks, seq_hash: int) -> None:
        """Recompute one (worker, block) pair's bits from the worker's tier sets."""
        bit = 1 << worker.slot
        on_device = seq_hash in worker.tiers["device"]
        lower = worker.fastest_lower(seq_hash)
        wanted = [(self._any, on_device or lower is not None)]
        wanted += [(maps, not on_device and tier == lower) for tier, maps in self._below.items()]
        for maps, held in wanted:
            mask = maps.get(seq_hash, 0)
            mask = mask | bit if held else mask & ~bit
            if mask:
                maps[seq_hash] = mask
            else:
                maps.pop(seq_hash, None)

    def blocks_of(self, worker_id: str) -> dict[str, set[int]]:
        """A copy of one worker's blocks by tier (tiers it holds nothing in are left out)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return {}
        return {tier: set(held) for tier, held in worker.tiers.items() if held}

    def __len__(self) -> int:
        return len(self._any)

    # ------------------------------------------------------------------ lookups

    def find_matches(self, hashes: Sequence[int]) -> Matches:
        """Longest cached prefix of `hashes` per worker."""
        out = Matches()
        if not hashes:
            return out
        get = self._any.get
        ids = self._slot_ids
        alive = get(hashes[0], 0)
        if not alive:
            return out
        if any(self._below.values()):
            return self._find_with_tiers(hashes, alive, out)
        for depth, seq_hash in enumerate(hashes):
            mask = get(seq_hash, 0) & alive
            if mask != alive:
                _record(out.blocks, ids, alive & ~mask, depth)
                alive = mask
                if not alive:
                    return out
        _record(out.blocks, ids, alive, len(hashes))
        return out

    def _find_with_tiers(self, hashes: Sequence[int], alive: int, out: Matches) -> Matches:
        get = self._any.get
        below = [(tier, maps.get) for tier, maps in self._below.items() if maps]
        ids = self._slot_ids
        counts: dict[int, dict[Tier, int]] = {}
        for depth, seq_hash in enumerate(hashes):
            mask = get(seq_hash, 0) & alive
            if mask != alive:
                _record(out.blocks, ids, alive & ~mask, depth)
                alive = mask
                if not alive:
                    break
            for tier, get_tier in below:
                lower = get_tier(seq_hash, 0) & alive
                while lower:
                    low = lower & -lower
                    per_tier = counts.setdefault(low.bit_length() - 1, {})
                    per_tier[tier] = per_tier.get(tier, 0) + 1
                    lower ^= low
        else:
            _record(out.blocks, ids, alive, len(hashes))
        out.lower = {ids[slot] or "": per_tier for slot, per_tier in counts.items()}
        return out


def _record(into: dict[str, int], ids: list[str | None], mask: int, depth: int) -> None:
    while mask:
        low = mask & -mask
        worker_id = ids[low.bit_length() - 1]
        if worker_id is not None:
            into[worker_id] = depth
        mask ^= low
