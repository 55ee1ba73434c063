"""The KV data plane's wire format and limits: how a decode worker pulls a prefill's KV.

A prefill-only request ends holding its prompt's KV; its last delta carries a `KvTransfer`
(protocol.py). The decode worker calls the prefill's request-plane endpoint `kv_blocks` with
a `KvBlocksCall`; the answer streams the records in order, through one of two transports:

- shared memory, when the caller is on this host: `KvShared` frames, each naming a batch of
  records (about `KV_BATCH_BYTES`) written into a segment (a file in `/dev/shm`, which is what
  POSIX `shm_open` makes on Linux) as soon as it is written, so the caller copies batch k out
  while the server writes batch k+1. The caller claims the segment by unlinking it on first
  sight; the server unlinks one still there at its expiry, so a caller that died leaks
  nothing. Plain files rather than `multiprocessing.shared_memory`: its resource tracker
  would unlink (and warn about) segments the other process still owns.
- a transfer engine's fabric between hosts, when both workers run one (kv_fabric.py): the
  server writes each batch into the caller's registered buffer through the fabric, then sends
  a `KvPushed` frame naming where it lies, so the records travel outside the request plane;
- the request plane's TCP stream: a `KvInline` frame, then one frame per record, the
  record's bytes as the frame's payload. No encoding around them, so the server writes each
  record as is (connection.py: large payloads skip the write batch) and the caller's only
  copy is the frame's decode; small records still share a write, batched by the plane.

A server turns to `KvInline` mid-stream when the segment or the fabric cannot be written (a
full `/dev/shm`, a peer the fabric cannot reach). Records are opaque here (kvbm records,
checked by the engine); the caller only bounds their number and size. Each transfer is
served once: the server releases the blocks after it, whatever the outcome, and a decode
worker recomputes what did not arrive.
"""

from __future__ import annotations

import asyncio
import functools
import mmap
import os
import re
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec

from orchestrator.runtime.request_plane.security import MAX_ANSWER_BYTES

# What a record may carry beyond `KvTransfer.block_bytes` of payload: kvbm's header
# (sequence hash, layout, checksum) with room to grow.
RECORD_HEADER_ALLOWANCE = 4096
# The largest record either transport accepts: one record must fit one answer frame.
MAX_RECORD_BYTES = MAX_ANSWER_BYTES - 1024
# Bytes per shared-memory batch: big enough that per-batch costs (a thread hop, a frame) are
# small, small enough that the caller starts copying early (1 and 4 MiB measure alike).
KV_BATCH_BYTES = 1024 * 1024
# Bytes per fabric write: a transfer engine's call has a fixed cost that shared memory's
# batches do not, and a decode uses its records only once all have come.
FABRIC_BATCH_BYTES = 16 * 1024 * 1024
# What a pull may have waiting before it is cancelled (client.py). A pull takes each record
# frame at once and copies one shared-memory batch at a time (its frames are small), so this
# only has to hold what one read of the socket brings: two of the largest records.
KV_PULL_BACKLOG_BYTES = 2 * MAX_ANSWER_BYTES
# Records per batch: under Linux's IOV_MAX (1024) for the segment's vectored writes.
MAX_BATCH_RECORDS = 512
SHM_DIR = Path("/dev/shm")
_SEGMENT_NAME = re.compile(r"weir-kv-[0-9a-f]{32}")
T = TypeVar("T")


class KvBlocksCall(msgspec.Struct, array_like=True):
    """The `kv_blocks` payload. `host_id`: the caller's, when it can read this host's shared
    memory (its `host_id()` equals the transfer's); empty asks for the TCP stream. `segment`:
    the name the caller chose for the shared-memory segment, so that it can remove the
    segment whatever happens to the server (`segment_name`). `fabric`: the caller's fabric
    session, when it has one, and the receive buffer registered there (`buffer`, its address
    in the caller; `capacity`, its bytes)."""

    transfer_id: str
    host_id: str = ""
    segment: str = ""
    fabric: str = ""
    buffer: int = 0
    capacity: int = 0


class KvInline(msgspec.Struct, tag=1, array_like=True):
    """Every later frame of this answer is one record, raw."""


class KvShared(msgspec.Struct, tag=2, array_like=True):
    """The next records lie in `segment` (a name in SHM_DIR), back to back from `offset`."""

    segment: str
    offset: int
    sizes: list[int]


class KvPushed(msgspec.Struct, tag=3, array_like=True):
    """The next records lie in the caller's fabric buffer, back to back from `offset`: each
    answer's records follow the previous answer's."""

    offset: int
    sizes: list[int]


KvAnswer = KvInline | KvShared | KvPushed
INLINE = msgspec.msgpack.encode(KvInline())

encode = msgspec.msgpack.Encoder().encode
decode_call = msgspec.msgpack.Decoder(KvBlocksCall).decode
decode_answer = msgspec.msgpack.Decoder(KvAnswer).decode


@functools.cache
def host_id() -> str:
    """Who shares this machine's shared memory: the kernel's boot id, the host name (pods on
    one node share the kernel, not /dev/shm) and the identity of the /dev/shm mount (two
    containers given one host name still mount their own). Empty when there is no /dev/shm:
    then every pull goes over TCP."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        shm = SHM_DIR.stat()
    except OSError:
        return ""
    return f"{boot}/{socket.gethostname()}/{shm.st_dev}:{shm.st_ino}"


def segment_name() -> str:
    """A fresh segment name, chosen by the caller of a pull."""
    return f"weir-kv-{secrets.token_hex(16)}"


def new_segment(name: str) -> int:
    """Create the segment `name` (of our pattern, not there yet) that only this user can read;
    a descriptor open for writing. OSError otherwise: a caller never makes us touch another
    file, nor one that exists."""
    if not _SEGMENT_NAME.fullmatch(name):
        raise OSError(f"not a KV segment name: {name!r}")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(SHM_DIR / name, flags, 0o600)


def open_segment(name: str) -> int:
    """Open the segment a server named and claim it (unlink: it lives on through the
    descriptor). Only names of our own pattern: a server never makes us touch another file."""
    if not _SEGMENT_NAME.fullmatch(name):
        raise ValueError(f"not a KV segment name: {name!r}")
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    os.unlink(path)
    return fd


def unlink_segment(name: str) -> bool:
    """Remove a segment its caller never claimed; False if it was claimed (already gone)."""
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        return False
    return True


async def in_thread_on(fd: int, call: Callable[..., T], *args: object) -> T:
    """`call(copy, *args)` in a thread, on a duplicate of `fd` that the thread closes. A
    cancelled pull closes `fd` at once while the thread may still be copying; with its own
    descriptor the thread can never touch a file opened later under the same number."""
    copy = os.dup(fd)

    def run() -> T:
        try:
            return call(copy, *args)
        finally:
            os.close(copy)

    return await asyncio.to_thread(run)


def write_records(fd: int, records: list[bytes], offset: int) -> None:
    """Blocking: `records` into the segment at `offset`, one system call (no user-space copy)."""
    size = sum(map(len, records))
    if os.pwritev(fd, records, offset) != size:
        raise OSError(f"short write of {size} bytes into a KV segment")


def map_records(fd: int, offset: int, sizes: list[int]) -> list[memoryview]:
    """Blocking: the records of `sizes` from `offset`, as views of the segment mapped into this
    process, not copies: the one copy this side makes is the engine's, into its KV cache. The
    segment is unlinked already, so its pages go when the last view of them does."""
    size = sum(sizes)
    if os.fstat(fd).st_size < offset + size:
        raise OSError("a KV segment is shorter than its answer said")
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    view = memoryview(mmap.mmap(fd, offset + size - start, prot=mmap.PROT_READ, offset=start))
    records: list[memoryview] = []
    position = offset - start
    for length in sizes:
        records.append(view[position : position + length])
        position += length
    return records


def batches(records: list[bytes], limit: int = KV_BATCH_BYTES) -> list[list[bytes]]:
    """`records` in consecutive groups of about `limit` bytes (a larger record goes alone) and
    at most MAX_BATCH_RECORDS records."""
    groups: list[list[bytes]] = []
    group: list[bytes] = []
    size = 0
    for record in records:
        if group and (size + len(record) > limit or len(group) == MAX_BATCH_RECORDS):
            groups.append(group)
            group, size = [], 0
        group.append(record)
        size += len(record)
    if group:
        groups.append(group)
    return groups
