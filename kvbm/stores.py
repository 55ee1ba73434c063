"""The stores below the engine's memory, one per tier, behind one small interface.

A store maps a block's sequence hash to its bytes. It is synchronous (the engine calls it
between steps, from its step thread) and bounded: `put` makes room by evicting its least
recently used blocks and returns their hashes, so the caller can publish the removals as KV
events. `get` returns the verified payload or None: a block that fails its checksum is
dropped and counts as a miss (records.py).

`HostStore` is G2: a buffer allocated once, one slot per block. With `block_bytes=0` it keeps
only which hashes it holds, which is what the mocker and the offline replay need: they move
no bytes, only time (its shared tier is a `HostStore` too, so it also speaks `RemoteStore`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from kvbm.records import Payload
from orchestrator.runtime.protocol import Tier

# What a remote store's watcher reports: blocks by hash (stored, or removed), or that it lost
# track and may have dropped any block unreported (cleared).
Report = Callable[[list[int]], None]
Cleared = Callable[[], None]


class KvStore(Protocol):
    tier: Tier
    capacity_blocks: int
    block_bytes: int  # payload bytes per block (0: hashes only)

    def __len__(self) -> int: ...

    def __contains__(self, seq_hash: int) -> bool: ...

    def get(self, seq_hash: int) -> Payload | None:
        """The block's payload, and it becomes the most recently used; None on a miss."""
        ...

    def put(self, seq_hash: int, payload: Payload) -> list[int]:
        """Store a block (a no-op if present, bar recency); returns the hashes evicted for it."""
        ...

    def discard(self, seq_hash: int) -> None: ...

    def hashes(self) -> list[int]: ...

    def close(self) -> None: ...


class PrefixStore(KvStore, Protocol):
    """A store that reads a sequence's prefix and writes a step's blocks in one call: the
    disk (G3), whose I/O on adjacent blocks is worth joining."""

    def get_prefix(self, hashes: Sequence[int]) -> list[Payload]:
        """The payloads of the leading `hashes` held intact, up to the first that is not; each
        becomes the most recently used."""
        ...

    def put_blocks(self, blocks: Sequence[tuple[int, Payload]]) -> list[int]:
        """`put` of each block in order, the last the most recently used (of more than the
        store holds, the last); returns the hashes evicted for them."""
        ...


class RemoteStore(KvStore, Protocol):
    """A store shared by a model's workers (G4): pipelined batches, and it can go away."""

    available: bool  # False while it is unreachable: every call is then a miss or a no-op

    def get_many(self, hashes: list[int]) -> list[Payload | None]: ...

    def put_many(self, items: list[tuple[int, Payload]]) -> None: ...

    def watch(self, stored: Report, removed: Report, cleared: Cleared) -> None:
        """Report, from a thread of the store's own, the blocks it holds that no call of this
        worker stored (`stored`), those it drops by itself (`removed`), and that it may have
        dropped any block unreported (`cleared`: after losing track, before reporting again
        what it holds)."""
        ...


class HostStore:
    """G2: host memory, preallocated. LRU over slots. `tier` is "host" but for the simulated
    stores of the mocker, which stand in for any tier with `block_bytes=0`."""

    def __init__(
        self, capacity_blocks: int, block_bytes: int, tier: Tier = "host", buffer: memoryview | None = None
    ) -> None:
        """`buffer`: writable memory of `capacity_blocks * block_bytes` bytes for the slots (an
        engine on a GPU passes pinned memory, which the device copies from directly); None
        allocates it here."""
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.tier = tier
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        if buffer is None:
            buffer = memoryview(bytearray(capacity_blocks * block_bytes))
        buffer = buffer.cast("B")
        needed = capacity_blocks * block_bytes
        if buffer.readonly or buffer.nbytes != needed:
            raise ValueError(f"the slots need {needed} writable bytes, got {buffer.nbytes}")
        self._view = buffer
        self._slots: OrderedDict[int, int] = OrderedDict()  # seq_hash -> slot, LRU first
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self.available = True  # memory does not go away (RemoteStore)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, seq_hash: int) -> bool:
        return seq_hash in self._slots

    def get(self, seq_hash: int) -> Payload | None:
        """A view of the block's slot, not a copy: it holds this block until the next `put`
        or `discard` (which may give the slot to another), so read it before then or copy it.
        The engine reads it in the step that loads it, and puts only after that step."""
        slot = self._slots.get(seq_hash)
        if slot is None:
            return None
        self._slots.move_to_end(seq_hash)
        start = slot * self.block_bytes
        return self._view[start : start + self.block_bytes]

    def put(self, seq_hash: int, payload: Payload) -> list[int]:
        if seq_hash in self._slots:
            self._slots.move_to_end(seq_hash)
            return []
        if len(payload) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes here, got {len(payload)}")
        slot, evicted = self.reserve(seq_hash)
        slot[:] = payload
        return evicted

    def reserve(self, seq_hash: int) -> tuple[memoryview, list[int]]:
        """A slot for `seq_hash`, which the store does not hold, for the caller to fill before
        anything reads it (an engine copies a block from its device straight into it); and
        the blocks evicted to make room, least recently used first."""
        if seq_hash in self._slots:
            raise ValueError(f"block {seq_hash:#x} is held already")
        evicted: list[int] = []
        if not self._free:
            old, slot = self._slots.popitem(last=False)
            self._free.append(slot)
            evicted.append(old)
        slot = self._free.pop()
        self._slots[seq_hash] = slot
        start = slot * self.block_bytes
        return self._view[start : start + self.block_bytes], evicted

    def get_many(self, hashes: list[int]) -> list[Payload | None]:
        return [self.get(h) for h in hashes]

    def put_blocks(self, blocks: Sequence[tuple[int, Payload]]) -> list[int]:
        evicted: list[int] = []
        for seq_hash, payload in blocks[-self.capacity_blocks :]:
            evicted += self.put(seq_hash, payload)
        return evicted

    def get_prefix(self, hashes: Sequence[int]) -> list[Payload]:
        payloads: list[Payload] = []
        for seq_hash in hashes:
            payload = self.get(seq_hash)
            if payload is None:
                break
            payloads.append(payload)
        return payloads

    def put_many(self, items: list[tuple[int, Payload]]) -> None:
        for seq_hash, payload in items:
            self.put(seq_hash, payload)

    def watch(self, stored: Report, removed: Report, cleared: Cleared) -> None:
        """Nothing to report (RemoteStore): memory drops a block only when a `put` evicts it."""

    def pop_oldest(self) -> tuple[int, Payload] | None:
        """Evict the least recently used block and hand back its bytes (to demote them)."""
        if not self._slots:
            return None
        seq_hash, slot = self._slots.popitem(last=False)
        self._free.append(slot)
        start = slot * self.block_bytes
        return seq_hash, bytes(self._view[start : start + self.block_bytes])

    def discard(self, seq_hash: int) -> None:
        slot = self._slots.pop(seq_hash, None)
        if slot is not None:
            self._free.append(slot)

    def hashes(self) -> list[int]:
        return list(self._slots)

    def close(self) -> None:
        self._slots.clear()
