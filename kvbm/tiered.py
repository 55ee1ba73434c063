"""The tiers below one engine's device cache, and how blocks move between them.

Policy, learned from NVIDIA Dynamo's KVBM and LMCache without copying either:

- Write-through from the device: every block the engine finishes computing is copied to host
  memory (G2) at the end of that step, and to the remote store (G4) when there is one, so a
  later device eviction costs nothing and another worker of the model can load the block
  from G4 at once. Host memory copies run at memcpy speed, far below a step's compute.
- Host evictions fall to disk (G3) only for blocks that were onboarded at least
  `disk_min_reuse` times: a block used once is unlikely to be used again, and the disk's write
  bandwidth is the scarcest thing here (Dynamo filters its SSD tier the same way).
- Lookups walk host, disk, remote in order and stop at the first block no tier holds (a
  prefix is only useful up to its first gap). A block found below the host is copied up to
  the host, so the next hit is a memory copy.
- Every store and removal in a tier is a KV event with that tier: the router credits a worker
  for blocks it can load (router/cost.py), and a G4 block for every worker of the model.

A block a tier cannot return intact is a miss (the engine recomputes it), counted in
`weir_kvbm_errors_total`. Nothing here touches torch: payloads are bytes (none at all in the
mocker's simulated stores, which keep only hashes).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvbm import metrics
from kvbm.stores import HostStore, KvStore
from orchestrator.runtime.protocol import BlockRemoved, BlockStored, KvEvent, Tier

# One fetched block: (seq_hash, the tier it came from, its payload).
Fetched = tuple[int, Tier, bytes]


class TieredStore:
    def __init__(
        self,
        host: HostStore,
        disk: KvStore | None = None,
        remote: KvStore | None = None,
        disk_min_reuse: int = 1,
    ) -> None:
        self.host = host
        self.disk = disk
        self.remote = remote
        self.disk_min_reuse = disk_min_reuse
        self.stores: list[KvStore] = [s for s in (host, disk, remote) if s is not None]
        self.block_bytes = host.block_bytes
        # seq_hash -> times onboarded, for the disk filter; bounded by what the tiers can hold.
        self._reuse: OrderedDict[int, int] = OrderedDict()
        self._reuse_limit = 2 * sum(min(s.capacity_blocks, 1 << 22) for s in self.stores)
        self._events: list[KvEvent] = []

    # ------------------------------------------------------------------ device -> tiers

    def offload(self, blocks: Iterable[tuple[int, bytes]]) -> None:
        """Blocks the device just computed, (seq_hash, payload): write-through to G2 (and G4)."""
        started = time.perf_counter()
        stored: list[int] = []
        fresh: list[tuple[int, bytes]] = []
        for seq_hash, payload in blocks:
            if seq_hash in self.host:
                continue
            self._make_host_room()
            self.host.put(seq_hash, payload)
            stored.append(seq_hash)
            fresh.append((seq_hash, payload))
        if not stored:
            return
        self._stored("host", stored)
        metrics.TRANSFER_SECONDS.labels("host", "offload").observe(time.perf_counter() - started)
        if self.remote is not None:
            started = time.perf_counter()
            for seq_hash, payload in fresh:
                self.remote.put(seq_hash, payload)
            if getattr(self.remote, "available", True):
                self._stored("remote", stored)
                metrics.TRANSFER_SECONDS.labels("remote", "offload").observe(time.perf_counter() - started)

    def _make_host_room(self) -> None:
        while len(self.host) >= self.host.capacity_blocks:
            oldest = self.host.pop_oldest()
            if oldest is None:
                return
            seq_hash, payload = oldest
            self._events.append(BlockRemoved(seq_hashes=[seq_hash], tier="host"))
            disk = self.disk
            reused = self._reuse.get(seq_hash, 0) >= self.disk_min_reuse
            if disk is not None and reused and seq_hash not in disk:
                evicted = disk.put(seq_hash, payload)
                if evicted:
                    self._events.append(BlockRemoved(seq_hashes=evicted, tier="disk"))
                if seq_hash in disk:  # a full disk stores nothing: no event for it
                    self._stored("disk", [seq_hash])

    def _stored(self, tier: Tier, hashes: list[int]) -> None:
        self._events.append(BlockStored(blocks=hashes, tier=tier))
        metrics.OFFLOAD_BLOCKS.labels(tier).inc(len(hashes))
        metrics.OFFLOAD_BYTES.labels(tier).inc(len(hashes) * self.block_bytes)

    # ------------------------------------------------------------------ tiers -> device

    def fetch_prefix(self, hashes: Sequence[int], memo: dict[int, tuple[Tier, bytes]]) -> list[Fetched]:
        """The leading blocks of `hashes` some tier holds, with their payloads, up to the first
        one none does. `memo` keeps what was fetched for a sequence that has to wait for room
        on the device, so its next attempt reads nothing again."""
        found: list[Fetched] = []
        for seq_hash in hashes:
            got = memo.get(seq_hash)
            if got is None:
                got = self._fetch(seq_hash)
                if got is None:
                    break
                memo[seq_hash] = got
            found.append((seq_hash, *got))
        return found

    def onboarded(self, blocks: Sequence[Fetched]) -> None:
        """The engine took these blocks into its device cache: count them (and their reuse)."""
        for seq_hash, tier, payload in blocks:
            metrics.ONBOARD_BLOCKS.labels(tier).inc()
            metrics.ONBOARD_BYTES.labels(tier).inc(len(payload) or self.block_bytes)
            self._reuse[seq_hash] = self._reuse.pop(seq_hash, 0) + 1
        while len(self._reuse) > self._reuse_limit:
            self._reuse.popitem(last=False)

    def _fetch(self, seq_hash: int) -> tuple[Tier, bytes] | None:
        for store in self.stores:
            tier = store.tier
            metrics.LOOKUPS.labels(tier).inc()
            if seq_hash not in store:
                continue
            started = time.perf_counter()
            payload = store.get(seq_hash)
            if payload is None:  # held, but not intact (or the store just went away)
                metrics.ERRORS.labels(tier).inc()
                continue
            metrics.HITS.labels(tier).inc()
            metrics.TRANSFER_SECONDS.labels(tier, "onboard").observe(time.perf_counter() - started)
            if store is not self.host:
                self._make_host_room()
                self.host.put(seq_hash, payload)
                self._stored("host", [seq_hash])
            return tier, payload
        return None

    # ------------------------------------------------------------------ observability

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        for store in self.stores:
            metrics.BLOCKS.labels(store.tier).set(len(store))
        return events

    def capacities(self) -> dict[str, int]:
        """Blocks each tier can hold, for the model card (0 for a shared remote store)."""
        return {s.tier: 0 if s is self.remote else s.capacity_blocks for s in self.stores}

    def snapshot(self) -> dict[Tier, list[int]]:
        return {store.tier: store.hashes() for store in self.stores}

    def close(self) -> None:
        for store in self.stores:
            store.close()
