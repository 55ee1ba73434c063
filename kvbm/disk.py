"""G3: KV blocks in one preallocated slab file on local disk, one fixed-size slot per block.

One file of fixed slots rather than a file per block: a block is one positioned write or read
(no open, no directory entry, no metadata journal), blocks in adjacent slots one for all of
them (`put_blocks`, `get_prefix`), and the space is claimed once, at open,
so a full disk shows itself up front instead of in the middle of a step. Slots are rounded up
to 4096 bytes so the file can be opened with O_DIRECT: the KV is read once, by the engine,
and caching it again in the page cache would only take memory from the host tier (G2).

The index (hash -> slot, in LRU order) is kept only in memory and rebuilt at open from the
slots' own headers. Nothing is written besides the records themselves, so there is no index
to corrupt or to fall behind: a block whose write was torn by a crash fails its checksum on
its first read and becomes a miss, like any other damaged block. Recency is not kept across
a restart; the blocks found at open start out in slot order.

A full disk is not an error for a cache. If the preallocation is refused the file stays
sparse, and a slot whose write then fails for want of space is retired: the store shrinks to
what the disk holds and goes on evicting within that.

The store is called from several threads at once (the transfer engine's pool, and the step
thread asking what it holds). Reads and writes are positioned (`preadv`, `pwrite`), each
from or into memory of its own, so I/O on distinct slots runs in parallel; only the index, the
free list and the count of reads in flight on each slot are under one lock, never held
across I/O. A slot is owned by one party at a time: free, being written (by the put that
claimed it; its block is in the index only once the write is done), or holding a block.
A slot with a read in flight is never claimed for a write, and a block forgotten while it
is being read (`discard`, or a failed check) keeps its slot until the last read of it ends,
so no read ever sees bytes change under it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from kvbm import records
from orchestrator.runtime.protocol import Tier
from orchestrator.runtime.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)

ALIGN = 4096
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _aligned(nbytes: int) -> memoryview:
    """`nbytes` of fresh memory aligned for O_DIRECT. From the allocator, not a new mapping:
    memory freed by earlier reads comes back without page faults, and without being zeroed."""
    memory = np.empty(nbytes + ALIGN, dtype=np.uint8)
    offset = -memory.ctypes.data % ALIGN
    return memory.data[offset : offset + nbytes]


def _runs(slots: list[int]) -> Iterator[tuple[int, int]]:
    """`slots` cut into runs of adjacent slots, each one I/O: (start, stop) indices into it."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield start, i
            start = i


def slot_bytes(block_bytes: int) -> int:
    """A slot holds the record header and the payload, rounded up to O_DIRECT's alignment."""
    return -(-(records.HEADER_BYTES + block_bytes) // ALIGN) * ALIGN


class DiskStore:
    """G3: a slab file of `capacity_blocks` slots under `directory`, one file per layout."""

    tier: Tier = "disk"

    def __init__(
        self,
        directory: Path,
        capacity_blocks: int,
        block_bytes: int,
        layout: int,
        *,
        o_direct: bool = True,
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.layout = layout
        self.slot_bytes = slot_bytes(block_bytes)
        self.path = directory / f"kv-{layout:016x}.slab"
        self._no_space = ThrottledWarning(log, every_s=60.0)
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._slots: OrderedDict[int, int] = OrderedDict()  # seq_hash -> slot, LRU first
        self._free: list[int] = []
        self._reading: dict[int, int] = {}  # slot -> reads of it in flight
        self._dropped: set[int] = set()  # slots forgotten while being read: the last read frees them
        self._fd, self.direct = self._open(o_direct)
        self._preallocate()
        try:
            self._scan()
        except OSError as e:
            # Some filesystems take the flag at open and refuse the I/O: the scan is the probe.
            if not self.direct or e.errno != errno.EINVAL:
                raise
            os.close(self._fd)
            self._fd, self.direct = self._open(False)
            self._scan()

    def _open(self, o_direct: bool) -> tuple[int, bool]:
        flags = os.O_RDWR | os.O_CREAT
        if o_direct:
            try:
                return os.open(self.path, flags | os.O_DIRECT, 0o644), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.info("%s: O_DIRECT refused by the filesystem, using buffered I/O", self.path)
        return os.open(self.path, flags, 0o644), False

    def _preallocate(self) -> None:
        size = self.capacity_blocks * self.slot_bytes
        if os.fstat(self._fd).st_size != size:
            os.ftruncate(self._fd, size)
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as e:
            if e.errno not in _NO_SPACE:
                raise
            self._no_space("%s: no space for %d bytes of KV slots, storing what fits", self.path, size)

    def _scan(self) -> None:
        """Rebuild the index from the slots' headers; a slot whose header does not name a
        block of this layout and size (or names one already found) is free."""
        self._slots.clear()
        self._free.clear()
        header = _aligned(ALIGN)
        for slot in range(self.capacity_blocks):
            got = os.preadv(self._fd, [header], slot * self.slot_bytes)
            seq_hash = self._header_hash(header[:got])
            if seq_hash is None or seq_hash in self._slots:
                self._free.append(slot)
            else:
                self._slots[seq_hash] = slot
        self._free.reverse()  # pop() hands out the lowest slot first

    def _header_hash(self, header: memoryview) -> int | None:
        if len(header) < records.HEADER_BYTES:
            return None
        magic, seq_hash, layout, _checksum, length = records.HEADER.unpack_from(header)
        if magic != records.MAGIC or layout != self.layout or length != self.block_bytes:
            return None
        return int(seq_hash)

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def __contains__(self, seq_hash: int) -> bool:
        with self._lock:
            return seq_hash in self._slots

    def get(self, seq_hash: int) -> records.Payload | None:
        payloads = self.get_prefix([seq_hash])
        return payloads[0] if payloads else None

    def get_prefix(self, hashes: Sequence[int]) -> list[records.Payload]:
        """The payloads of the leading `hashes` held intact, up to the first block that is not
        (a damaged one is dropped): a sequence's prefix, as onboarding reads it. Each run of
        blocks in adjacent slots, which a sequence's blocks offloaded in order usually are, is
        one read, so the disk streams a few large reads instead of waiting out one per block.
        The reads go into fresh memory that the payloads are views of: nothing is copied."""
        slots = self._pin_prefix(hashes)
        if not slots:
            return []
        payloads: list[records.Payload] = []
        damaged: int | None = None
        try:
            size = self.slot_bytes
            memory = _aligned(len(slots) * size)
            for start, stop in _runs(slots):
                view = memory[start * size : stop * size]
                got = os.preadv(self._fd, [view], slots[start] * size)
                for k, slot in enumerate(slots[start:stop]):
                    seq_hash = hashes[start + k]
                    checked = records.decode(view[k * size : min(got, (k + 1) * size)], seq_hash, self.layout)
                    if checked is None:
                        damaged = seq_hash
                        log.warning(
                            "%s: block %016x in slot %d failed its check, dropped", self.path, seq_hash, slot
                        )
                        return payloads
                    payloads.append(checked)
            return payloads
        finally:  # a block that could not be read intact is dropped
            for seq_hash, slot in zip(hashes, slots, strict=False):
                self._end_read(slot, seq_hash if seq_hash == damaged else None)

    def _pin_prefix(self, hashes: Sequence[int]) -> list[int]:
        """The slots of the leading `hashes` held, which become the most recently used and are
        not reused until `_end_read`: a read of them is in flight in between."""
        slots: list[int] = []
        with self._lock:
            for seq_hash in hashes:
                slot = self._slots.get(seq_hash)
                if slot is None:
                    break
                self._slots.move_to_end(seq_hash)
                self._reading[slot] = self._reading.get(slot, 0) + 1
                slots.append(slot)
        return slots

    def _end_read(self, slot: int, drop: int | None) -> None:
        """A read of `slot` is over; `drop` is the block it held, when that failed its check.
        The last read of a slot whose block was forgotten meanwhile wipes and frees it."""
        with self._lock:
            if drop is not None and self._slots.get(drop) == slot:
                del self._slots[drop]
                self._dropped.add(slot)
            left = self._reading.pop(slot) - 1
            if left:
                self._reading[slot] = left
                return
            if slot not in self._dropped:
                return
            self._dropped.remove(slot)
        self._wipe(slot)

    def put(self, seq_hash: int, payload: records.Payload) -> list[int]:
        """Store a block; a disk too full to take it stores nothing (the evicted hashes are
        still returned: those blocks are gone)."""
        return self.put_blocks([(seq_hash, payload)])

    def put_blocks(self, blocks: Sequence[tuple[int, records.Payload]]) -> list[int]:
        """Store blocks, the last the most recently used (one already held only becomes the
        most recently used); returns the hashes evicted for them. Blocks given slots that are
        adjacent, as the free slots and the blocks evicted together mostly are, go in one
        write a run: the disk takes a few large writes instead of one per block. More blocks
        than the disk holds store the last of them; a disk too full stores what fits."""
        claims: list[tuple[int, int, records.Payload]] = []  # (slot, seq_hash, payload)
        evicted: list[int] = []
        with self._lock:
            fresh: dict[int, records.Payload] = {}
            for seq_hash, payload in blocks:
                if seq_hash in self._slots:
                    self._slots.move_to_end(seq_hash)
                elif len(payload) != self.block_bytes:
                    raise ValueError(f"a block is {self.block_bytes} bytes here, got {len(payload)}")
                else:
                    fresh[seq_hash] = payload
            for seq_hash, payload in list(fresh.items())[-self.capacity_blocks :]:
                claimed = self._claim()
                if claimed is None:
                    break
                slot, old = claimed
                if old is not None:
                    evicted.append(old)
                claims.append((slot, seq_hash, payload))
        runs = _runs([slot for slot, _, _ in claims])
        written = [claim for start, stop in runs for claim in self._write_run(claims[start:stop])]
        with self._lock:
            for slot, seq_hash, _ in written:
                if seq_hash in self._slots:  # a concurrent put of the same block ended first
                    self._free.append(slot)
                else:
                    self._slots[seq_hash] = slot
        return evicted

    def _write_run(
        self, run: list[tuple[int, int, records.Payload]]
    ) -> list[tuple[int, int, records.Payload]]:
        """Write the records of a run of adjacent slots (which the caller owns) at once; the
        claims written. A run the disk cannot take whole goes again a slot at a time, so that
        a full disk retires the slots it has no room for and keeps the rest."""
        size = self.slot_bytes
        memory = _aligned(len(run) * size)
        for k, (_, seq_hash, payload) in enumerate(run):
            records.encode_into(memory[k * size : (k + 1) * size], seq_hash, self.layout, payload)
        if len(run) > 1 and self._write_all(run[0][0], memory):
            return run
        return [
            claim for k, claim in enumerate(run) if self._write(claim[0], memory[k * size : (k + 1) * size])
        ]

    def _claim(self) -> tuple[int, int | None] | None:
        """Under the lock: a slot to write and the block evicted for it, if any. A free slot,
        or the least recently used block's that no read is in flight on; None when every
        slot is retired or being read."""
        if self._free:
            return self._free.pop(), None
        for old, slot in self._slots.items():
            if slot not in self._reading:
                del self._slots[old]
                return slot, old
        return None

    def _write_all(self, slot: int, data: memoryview) -> bool:
        """Write `data` from `slot` on; False if the disk took less (out of space)."""
        try:
            return os.pwrite(self._fd, data, slot * self.slot_bytes) == len(data)
        except OSError as e:
            if e.errno not in _NO_SPACE:
                raise
            return False

    def _write(self, slot: int, data: memoryview) -> bool:
        """Write `data` to `slot` (which the caller owns); False, and the slot retired, when
        the disk is full (a short write is one that ran out of space)."""
        if self._write_all(slot, data):
            return True
        with self._lock:
            self.capacity_blocks -= 1
            capacity = self.capacity_blocks
        self._no_space("%s: disk full, now %d KV slots", self.path, capacity)
        return False

    def discard(self, seq_hash: int) -> None:
        """Forget the block, and wipe its header so that a reopen does not find it again."""
        with self._lock:
            slot = self._slots.pop(seq_hash, None)
            if slot is None:
                return
            if slot in self._reading:  # the last read of it wipes it (_end_read)
                self._dropped.add(slot)
                return
        self._wipe(slot)

    def _wipe(self, slot: int) -> None:
        """Zero the header of a slot no one else holds, then free it."""
        zeros = _aligned(ALIGN)
        zeros[:] = bytes(ALIGN)
        if self._write(slot, zeros):
            with self._lock:
                self._free.append(slot)

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._slots)

    def close(self) -> None:
        """After the threads that use the store have stopped (TieredStore closes its transfer
        engine first)."""
        with self._lock:
            if self._fd < 0:
                return
            os.close(self._fd)
            self._fd = -1
            self._slots.clear()
            self._free.clear()
