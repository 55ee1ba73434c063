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
  for blocks it can load (router/cost.py), and a G4 block for every worker of the model. The
  remote store's own thread adds the events no call here makes (`RemoteStore.watch`): the
  blocks Redis expires or evicts by itself, those it held before this worker started, and,
  after the thread lost track of Redis, the remote tier cleared before it reports again.
  A snapshot holds no remote blocks (`RedisStore.hashes`): they follow it as events.

- Host memory is read and written on the engine's step thread. A host hit is a view of its
  slot, not a copy (the load into the device is the one copy), so nothing may put into host
  memory between a step's lookups and the end of that step: the copy-up of blocks a step
  onboards from disk or the remote store waits for the step's `offload`, the first put after
  it. (Put at once, it could evict the slot of a block the same step is loading.) With a
  `TransferEngine`, everything the disk and the remote store do runs on its pool of threads
  instead: offloads are queued (and skipped when the queue is full), and a prefix that
  continues on a slow tier is read there while its sequence waits (`Fetch.running`), so a
  step never waits for a disk or a network. Reads for several sequences and Redis writes
  run at once (one sequence has one read at a time); what a step evicts for the disk is one
  write job (`put_blocks`), and the jobs run one at a time, each with its events, so that the
  events of a block stored by one job and evicted by another come in the order the disk did
  both. Without an engine (the mocker, which moves no bytes) all of it runs inline.

A block a tier cannot return intact is a miss (the engine recomputes it), counted in
`weir_kvbm_errors_total`. Nothing here touches torch: payloads are bytes, or views of host
memory (none at all in the mocker's simulated stores, which keep only hashes). Every metric
carries this store's `worker` label (metrics.py): the instance id of the worker that serves
the engine (`worker_id`), or one built from `name` for an engine no worker serves.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from functools import partial

from kvbm import metrics
from kvbm.records import Payload
from kvbm.stores import HostStore, KvStore, PrefixStore, RemoteStore
from kvbm.transfer import TransferEngine
from orchestrator.runtime.protocol import AllCleared, BlockRemoved, BlockStored, KvEvent, Tier

# One fetched block: (seq_hash, the tier it came from, its payload).
Fetched = tuple[int, Tier, Payload]
# Writes blocks, by hash, into the host slots given for them (TieredStore.offload_into).
Fill = Callable[[list[int], list[memoryview]], None]

# Blocks one read job takes from the slow tiers; a longer prefix continues in a later job, so
# a sequence holds at most this many payloads it has not yet been admitted with.
READ_BATCH_BLOCKS = 64


class Fetch:
    """What the tiers have found of one waiting sequence's prefix: payloads read so far (kept
    until it is admitted, so a retry reads nothing twice), whether a slow-tier read is still
    running for it, and whether the slow tiers ran out (a later walk stops there)."""

    __slots__ = ("done", "found", "running")

    def __init__(self) -> None:
        self.found: dict[int, tuple[Tier, Payload]] = {}
        self.running = False
        self.done = False


class TieredStore:
    def __init__(
        self,
        host: HostStore,
        disk: PrefixStore | None = None,
        remote: RemoteStore | None = None,
        disk_min_reuse: int = 1,
        transfer: TransferEngine | None = None,
        name: str = "kvbm",
        worker_id: str = "",
    ) -> None:
        self.worker = worker_id or metrics.worker_label(name)
        self.host = host
        self.disk = disk
        self.remote = remote
        self.disk_min_reuse = disk_min_reuse
        self.transfer = transfer
        self.stores: list[KvStore] = [s for s in (host, disk, remote) if s is not None]
        self.block_bytes = host.block_bytes
        # seq_hash -> times onboarded, for the disk filter; bounded by what the tiers can hold.
        self._reuse: OrderedDict[int, int] = OrderedDict()
        self._reuse_limit = 2 * sum(min(s.capacity_blocks, 1 << 22) for s in self.stores)
        # Blocks this step onboarded from a slow tier, for host memory once the step ends.
        self._promotions: list[tuple[int, Payload]] = []
        self._events: list[KvEvent] = []
        self._events_lock = threading.Lock()  # transfer jobs and the remote store's watcher add events too
        self._disk_writes = threading.Lock()  # one disk write at a time (module docstring)
        if remote is not None:
            remote.watch(
                lambda hashes: self._event(BlockStored(blocks=hashes, tier="remote")),
                lambda hashes: self._event(BlockRemoved(seq_hashes=hashes, tier="remote")),
                lambda: self._event(AllCleared(tier="remote")),
            )

    # ------------------------------------------------------------------ device -> tiers

    def offload(self, blocks: Iterable[tuple[int, Payload]]) -> None:
        """Blocks the device just computed, (seq_hash, payload): `offload_into`, copying each
        payload into its slot."""
        payloads = dict(blocks)

        def fill(hashes: list[int], slots: list[memoryview]) -> None:
            for seq_hash, slot in zip(hashes, slots, strict=True):
                slot[:] = payloads[seq_hash]

        self.offload_into(list(payloads), fill)

    def offload_into(self, hashes: Sequence[int], fill: Fill) -> None:
        """Blocks the device just computed: write-through to G2 (and G4). Those host memory
        does not hold yet get slots, which `fill(their hashes, slots)` writes, the engine's
        cache straight from the device (pinned memory on a GPU, so one copy at the link's
        speed). The engine calls it at the end of every step, loads done: the step's
        copy-ups from the slow tiers go into host memory first (`onboarded`)."""
        if self._promotions:
            self._promote()
        started = time.perf_counter()
        fresh = list(dict.fromkeys(h for h in hashes if h not in self.host))
        if not fresh:
            return
        # A host's worth at a time, as more would evict slots not filled yet: the blocks of a
        # step larger than host memory pass through it to the disk as any others do.
        capacity = self.host.capacity_blocks
        for start in range(0, len(fresh), capacity):
            self._offload_batch(fresh[start : start + capacity], fill)
        metrics.TRANSFER_SECONDS.labels(self.worker, "host", "offload").observe(time.perf_counter() - started)

    def _offload_batch(self, hashes: list[int], fill: Fill) -> None:
        slots: list[memoryview] = []
        demoted: list[tuple[int, Payload]] = []
        for seq_hash in hashes:
            self._make_host_room(demoted)
            slot, _ = self.host.reserve(seq_hash)  # room made: it evicts nothing
            slots.append(slot)
        self._demote(demoted)
        fill(hashes, slots)
        self._stored("host", hashes)
        if self.remote is not None:
            # Copies: a slot may hold another block by the time the transfer thread writes.
            blocks: list[tuple[int, Payload]] = [(h, bytes(s)) for h, s in zip(hashes, slots, strict=True)]
            self._slow(partial(self._write_remote, blocks))

    def _make_host_room(self, demoted: list[tuple[int, Payload]]) -> None:
        """Evict from host memory until a block fits; those bound for the disk join `demoted`."""
        while len(self.host) >= self.host.capacity_blocks:
            oldest = self.host.pop_oldest()
            if oldest is None:
                return
            seq_hash, payload = oldest
            self._event(BlockRemoved(seq_hashes=[seq_hash], tier="host"))
            reused = self._reuse.get(seq_hash, 0) >= self.disk_min_reuse
            if self.disk is not None and reused and seq_hash not in self.disk:
                demoted.append((seq_hash, payload))

    def _demote(self, blocks: list[tuple[int, Payload]]) -> None:
        """Write a step's evictions from host memory to disk as one job: blocks evicted
        together mostly get adjacent slots there, and go in one write (`put_blocks`)."""
        if blocks:
            self._slow(partial(self._write_disk, blocks))

    def _write_disk(self, blocks: list[tuple[int, Payload]]) -> None:
        disk = self.disk
        assert disk is not None
        with self._disk_writes:
            blocks = [(seq_hash, payload) for seq_hash, payload in blocks if seq_hash not in disk]
            if not blocks:
                return
            evicted = disk.put_blocks(blocks)
            if evicted:
                self._event(BlockRemoved(seq_hashes=evicted, tier="disk"))
            stored = [seq_hash for seq_hash, _ in blocks if seq_hash in disk]
            if stored:  # a full disk stores what fits: no event for the rest
                self._stored("disk", stored)

    def _write_remote(self, blocks: list[tuple[int, Payload]]) -> None:
        remote = self.remote
        assert remote is not None
        started = time.perf_counter()
        remote.put_many(blocks)
        if remote.available:
            self._stored("remote", [seq_hash for seq_hash, _ in blocks])
            metrics.TRANSFER_SECONDS.labels(self.worker, "remote", "offload").observe(
                time.perf_counter() - started
            )

    # ------------------------------------------------------------------ tiers -> device

    def fetch_prefix(self, hashes: Sequence[int], fetch: Fetch) -> tuple[list[Fetched], bool]:
        """The leading blocks of `hashes` some tier holds, with their payloads, up to the first
        one none does; and whether the sequence should wait, because a slow tier is reading
        more of its prefix (started now, or earlier and not finished)."""
        found: list[Fetched] = []
        for i, seq_hash in enumerate(hashes):
            got = fetch.found.get(seq_hash) or self._from_host(seq_hash)
            if got is None:
                if fetch.running:
                    return found, True
                if fetch.done or not self._slow_may_hold(seq_hash):
                    break
                rest = list(hashes[i : i + READ_BATCH_BLOCKS])
                fetch.running = True
                if self.transfer is None:
                    self._read_slow(rest, fetch)
                    got = fetch.found.get(seq_hash)
                    if got is None:
                        break
                elif self.transfer.submit(partial(self._read_slow, rest, fetch)):
                    return found, True
                else:  # the transfer queue is full: this walk ends here
                    fetch.running = False
                    break
            found.append((seq_hash, *got))
        return found, False

    def _from_host(self, seq_hash: int) -> tuple[Tier, Payload] | None:
        metrics.LOOKUPS.labels(self.worker, "host").inc()
        payload = self.host.get(seq_hash)
        if payload is None:
            return None
        metrics.HITS.labels(self.worker, "host").inc()
        return "host", payload

    def _slow_may_hold(self, seq_hash: int) -> bool:
        # The disk's index is local (a dict lookup); the remote store can only be asked.
        return self.remote is not None or (self.disk is not None and seq_hash in self.disk)

    def _read_slow(self, hashes: list[int], fetch: Fetch) -> None:
        """Read `hashes` in order from disk, then the rest from the remote store, up to the
        first block neither returns intact. On a transfer thread when there is one."""
        ran_out = False
        try:
            i = 0 if self.disk is None else self._read_disk(hashes, fetch)
            if i < len(hashes) and self.remote is not None:
                i += self._read_remote(hashes[i:], fetch)
            ran_out = i < len(hashes)
        finally:
            fetch.done = ran_out
            fetch.running = False

    def _read_disk(self, hashes: list[int], fetch: Fetch) -> int:
        """How many leading `hashes` the disk returned intact (`DiskStore.get_prefix`)."""
        disk = self.disk
        assert disk is not None
        held = 0
        while held < len(hashes) and hashes[held] in disk:
            held += 1
        if not held:
            return 0
        started = time.perf_counter()
        payloads = disk.get_prefix(hashes[:held])
        metrics.TRANSFER_SECONDS.labels(self.worker, "disk", "onboard").observe(time.perf_counter() - started)
        metrics.LOOKUPS.labels(self.worker, "disk").inc(min(len(payloads) + 1, held))
        metrics.HITS.labels(self.worker, "disk").inc(len(payloads))
        # Held, but not intact (or a concurrent write evicted it): the read stopped there.
        if len(payloads) < held:
            metrics.ERRORS.labels(self.worker, "disk").inc()
        for seq_hash, payload in zip(hashes, payloads, strict=False):
            fetch.found[seq_hash] = ("disk", payload)
        return len(payloads)

    def _read_remote(self, hashes: list[int], fetch: Fetch) -> int:
        """How many leading `hashes` the remote store returned, in one pipelined batch."""
        remote = self.remote
        assert remote is not None
        started = time.perf_counter()
        payloads = remote.get_many(hashes)
        metrics.TRANSFER_SECONDS.labels(self.worker, "remote", "onboard").observe(
            time.perf_counter() - started
        )
        n = 0
        for seq_hash, payload in zip(hashes, payloads, strict=True):
            metrics.LOOKUPS.labels(self.worker, "remote").inc()
            if payload is None:
                break
            metrics.HITS.labels(self.worker, "remote").inc()
            fetch.found[seq_hash] = ("remote", payload)
            n += 1
        return n

    def onboarded(self, blocks: Sequence[Fetched]) -> None:
        """The engine took these blocks into its device cache: count them (and their reuse),
        and keep those read from a slow tier in host memory from the step's `offload` on, so
        the next hit is a copy."""
        for seq_hash, tier, payload in blocks:
            metrics.ONBOARD_BLOCKS.labels(self.worker, tier).inc()
            metrics.ONBOARD_BYTES.labels(self.worker, tier).inc(len(payload) or self.block_bytes)
            self._reuse[seq_hash] = self._reuse.pop(seq_hash, 0) + 1
            if tier != "host":
                self._promotions.append((seq_hash, payload))
        while len(self._reuse) > self._reuse_limit:
            self._reuse.popitem(last=False)

    def _promote(self) -> None:
        promoted: list[int] = []
        demoted: list[tuple[int, Payload]] = []
        for seq_hash, payload in self._promotions:
            if seq_hash not in self.host:
                self._make_host_room(demoted)
                self.host.put(seq_hash, payload)
                promoted.append(seq_hash)
        self._promotions.clear()
        self._demote(demoted)
        if promoted:
            self._stored("host", promoted)

    # ------------------------------------------------------------------ observability

    def _slow(self, job: Callable[[], None]) -> None:
        if self.transfer is None:
            job()
        elif not self.transfer.submit(job):
            metrics.SKIPPED.labels(self.worker).inc()

    def _event(self, event: KvEvent) -> None:
        with self._events_lock:
            self._events.append(event)

    def _stored(self, tier: Tier, hashes: list[int]) -> None:
        self._event(BlockStored(blocks=hashes, tier=tier))
        metrics.OFFLOAD_BLOCKS.labels(self.worker, tier).inc(len(hashes))
        metrics.OFFLOAD_BYTES.labels(self.worker, tier).inc(len(hashes) * self.block_bytes)

    def take_events(self) -> list[KvEvent]:
        with self._events_lock:
            events, self._events = self._events, []
        for store in self.stores:
            metrics.BLOCKS.labels(self.worker, store.tier).set(len(store))
        return events

    def capacities(self) -> dict[str, int]:
        """Blocks each tier can hold, for the model card (0 for a shared remote store)."""
        return {s.tier: 0 if s is self.remote else s.capacity_blocks for s in self.stores}

    def snapshot(self) -> dict[Tier, list[int]]:
        return {store.tier: store.hashes() for store in self.stores}

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
        for store in self.stores:
            store.close()
