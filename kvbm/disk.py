"""G3: KV blocks in one preallocated slab file on local disk, one fixed-size slot per block.

One file of fixed slots rather than a file per block: a block is one positioned write or read
(no open, no directory entry, no metadata journal), and the space is claimed once, at open,
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
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections import OrderedDict
from pathlib import Path

from kvbm import records
from orchestrator.runtime.protocol import Tier
from orchestrator.runtime.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)

ALIGN = 4096
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


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
        # O_DIRECT needs the memory side aligned too: an anonymous mmap is page-aligned.
        self._buffer = mmap.mmap(-1, self.slot_bytes)
        self._view = memoryview(self._buffer)
        directory.mkdir(parents=True, exist_ok=True)
        self._slots: OrderedDict[int, int] = OrderedDict()  # seq_hash -> slot, LRU first
        self._free: list[int] = []
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
        header = self._view[:ALIGN]
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
        return len(self._slots)

    def __contains__(self, seq_hash: int) -> bool:
        return seq_hash in self._slots

    def get(self, seq_hash: int) -> bytes | None:
        slot = self._slots.get(seq_hash)
        if slot is None:
            return None
        got = os.preadv(self._fd, [self._view], slot * self.slot_bytes)
        payload = records.decode(self._view[:got], seq_hash, self.layout)
        if payload is None:
            log.warning("%s: block %016x in slot %d failed its check, dropped", self.path, seq_hash, slot)
            self.discard(seq_hash)
            return None
        self._slots.move_to_end(seq_hash)
        return payload

    def put(self, seq_hash: int, payload: bytes) -> list[int]:
        """Store a block; a disk too full to take it stores nothing (the evicted hashes are
        still returned: those blocks are gone)."""
        if seq_hash in self._slots:
            self._slots.move_to_end(seq_hash)
            return []
        if len(payload) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes here, got {len(payload)}")
        evicted: list[int] = []
        if not self._free:
            if not self._slots:
                return []  # every slot retired: the disk holds not one block
            old, slot = self._slots.popitem(last=False)
            self._free.append(slot)
            evicted.append(old)
        slot = self._free.pop()
        record = records.encode(seq_hash, self.layout, payload)
        self._view[: len(record)] = record
        if self._write(slot, self.slot_bytes):
            self._slots[seq_hash] = slot
        return evicted

    def _write(self, slot: int, length: int) -> bool:
        """Write the buffer's first `length` bytes to `slot`; False, and the slot retired,
        when the disk is full (a short write is one that ran out of space)."""
        try:
            written = os.pwrite(self._fd, self._view[:length], slot * self.slot_bytes)
        except OSError as e:
            if e.errno not in _NO_SPACE:
                raise
            written = -1
        if written != length:
            self.capacity_blocks -= 1
            self._no_space("%s: disk full, now %d KV slots", self.path, self.capacity_blocks)
            return False
        return True

    def discard(self, seq_hash: int) -> None:
        """Forget the block, and wipe its header so that a reopen does not find it again."""
        slot = self._slots.pop(seq_hash, None)
        if slot is None:
            return
        self._view[:ALIGN] = bytes(ALIGN)
        if self._write(slot, ALIGN):
            self._free.append(slot)

    def hashes(self) -> list[int]:
        return list(self._slots)

    def close(self) -> None:
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        self._slots.clear()
        self._free.clear()
        self._view.release()
        self._buffer.close()
