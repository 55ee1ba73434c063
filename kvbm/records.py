"""One KV block as bytes outside the engine: a fixed header, then the block's KV.

The header names what the bytes are (the block's sequence hash and the layout id: model,
dtype, block size and KV shape in one number, so a block written by another model or layout
never matches) and carries a checksum of the payload. Every store below the engine's own
memory keeps blocks in this form, and a record whose header or checksum does not check out
is a miss: the engine recomputes the block rather than trust it.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"WEIRKV01"
# magic, seq_hash, layout_id, checksum, payload length. The checksum is xxh3-64 of the payload
# seeded with the hash and layout, so a flipped bit in either header field fails it too (a disk
# store rebuilds its index from these headers).
HEADER = struct.Struct("<8sQQQI")
HEADER_BYTES = HEADER.size

# A block's KV as the stores hand it around: bytes, or a view into a record or a buffer that
# the holder keeps alive (no copy of a block's megabytes just to drop its header).
Payload = bytes | memoryview


def layout_id(*parts: object) -> int:
    """A 64-bit id for a KV layout, from whatever determines it (model, dtype, block size,
    layers, heads, head size)."""
    return xxhash.xxh3_64_intdigest(repr(parts).encode())


def _checksum(seq_hash: int, layout: int, payload: Payload) -> int:
    return xxhash.xxh3_64_intdigest(payload, seed=seq_hash ^ layout)


def encode(seq_hash: int, layout: int, payload: Payload) -> bytes:
    checksum = _checksum(seq_hash, layout, payload)
    return HEADER.pack(MAGIC, seq_hash, layout, checksum, len(payload)) + payload


def encode_into(buffer: memoryview, seq_hash: int, layout: int, payload: Payload) -> int:
    """`encode` written into `buffer` (a store's reused I/O buffer): no intermediate record.
    Returns the record's length."""
    checksum = _checksum(seq_hash, layout, payload)
    HEADER.pack_into(buffer, 0, MAGIC, seq_hash, layout, checksum, len(payload))
    end = HEADER_BYTES + len(payload)
    buffer[HEADER_BYTES:end] = payload
    return end


def decode(record: Payload, seq_hash: int, layout: int) -> memoryview | None:
    """The payload of `record` if it is the block `seq_hash` of `layout`, intact; else None.
    A view into `record`, not a copy: copy it if `record`'s buffer is about to be reused."""
    if len(record) < HEADER_BYTES:
        return None
    magic, stored_hash, stored_layout, checksum, length = HEADER.unpack_from(record)
    if magic != MAGIC or stored_hash != seq_hash or stored_layout != layout:
        return None
    payload = memoryview(record)[HEADER_BYTES : HEADER_BYTES + length]
    if len(payload) != length or _checksum(seq_hash, layout, payload) != checksum:
        return None
    return payload
