"""The decode side of the KV data plane: `pull_kv` fetches a transfer's records from the
prefill worker that holds them (kv_transfer.py has the wire format).

A pull never raises for what the network or the other worker does: it returns the records
that arrived, in order, possibly none, and the decode engine recomputes the rest. So a
prefill worker SIGKILLed mid-transfer costs its request some recompute, never the request.
It accepts no more records than the transfer names and none larger than its block size
allows: the first record over either bound ends the pull (later ones could not extend a
contiguous prefix anyway). A fabric's records must fill its buffer in order, within its size.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from orchestrator.runtime import worker_metrics as metrics
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.kv_fabric import KvFabric, ReceiveBuffer
from orchestrator.runtime.kv_transfer import (
    KV_PULL_BACKLOG_BYTES,
    MAX_RECORD_BYTES,
    RECORD_HEADER_ALLOWANCE,
    KvBlocksCall,
    KvInline,
    KvPushed,
    KvShared,
    decode_answer,
    encode,
    host_id,
    in_thread_on,
    map_records,
    open_segment,
    segment_name,
    unlink_segment,
)
from orchestrator.runtime.protocol import KvTransfer
from orchestrator.runtime.request_plane.client import RequestPlaneClient
from orchestrator.runtime.request_plane.worker_client import KV_BLOCKS
from orchestrator.runtime.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)
_warn = ThrottledWarning(log)


class _Refused(ValueError):
    pass


class _Pull:
    """What one pull has accepted, and the claimed segment or the fabric buffer it reads from,
    if any."""

    def __init__(
        self, wanted: int, max_record: int, worker_id: str, segment: str, received: _Received | None
    ) -> None:
        self.wanted = wanted
        self.max_record = max_record
        self.worker_id = worker_id
        self.records: list[bytes | memoryview] = []
        self.size = 0
        self.transport = "tcp"
        self._inline = False  # past the answer's KvInline: each frame is a record
        self._segment = segment  # the one this pull named, "" for none
        self._fd: int | None = None
        self._received = received

    async def take(self, payload: bytes) -> None:
        """One frame of the answer."""
        answer: KvShared | KvPushed | None = None
        if self._inline:
            sizes = [len(payload)]
        else:
            decoded = decode_answer(payload)
            if isinstance(decoded, KvInline):
                self._inline = True
                return
            answer, sizes = decoded, decoded.sizes
        count, refused = self._acceptable(sizes)
        accepted: list[bytes | memoryview] = []
        if count:
            if answer is None:
                accepted.append(payload)
            elif isinstance(answer, KvShared):
                accepted += await self._read(answer, count)
            else:
                accepted += self._pushed(answer, count)
        self.records += accepted
        self.size += sum(map(len, accepted))
        if refused:
            metrics.KV_RECORDS_REFUSED.labels(self.worker_id, refused).inc()
            raise _Refused(f"refused a record: {refused}")

    async def _read(self, answer: KvShared, count: int) -> list[memoryview]:
        if answer.segment != self._segment or not self._segment:
            raise ValueError("the answer names a shared-memory segment this pull did not ask for")
        if self._fd is None:  # claimed (unlinked) on first sight: gone even if this pull dies
            self._fd, self.transport = open_segment(answer.segment), "shm"
        return await in_thread_on(self._fd, map_records, answer.offset, answer.sizes[:count])

    def _pushed(self, answer: KvPushed, count: int) -> list[memoryview]:
        received = self._received
        if received is None:
            raise ValueError("the answer names a fabric buffer this pull did not offer")
        self.transport = received.transport
        return received.take(answer.offset, answer.sizes[:count])

    def _acceptable(self, sizes: list[int]) -> tuple[int, str]:
        """How many of `sizes` may be taken, and why the next one may not ("" if all may)."""
        room = self.wanted - len(self.records)
        for i, size in enumerate(sizes):
            if i >= room:
                return i, "surplus"
            if size > self.max_record:
                return i, "oversized"
        return len(sizes), ""

    def close(self, complete: bool) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._received is not None:
            self._received.buffer.close(complete)


class _Received:
    """A fabric buffer offered to the server, read in the order the server filled it."""

    def __init__(self, buffer: ReceiveBuffer, transport: str) -> None:
        self.buffer = buffer
        self.transport = transport
        self._end = 0  # where the next answer's records must start

    def take(self, offset: int, sizes: list[int]) -> list[memoryview]:
        end = offset + sum(sizes)
        if offset != self._end or end > len(self.buffer.view):
            raise ValueError(f"fabric records at {offset}..{end} out of order or past the buffer")
        records: list[memoryview] = []
        for size in sizes:
            records.append(self.buffer.view[offset : offset + size])
            offset += size
        self._end = end
        return records


def _offer_buffer(fabric: KvFabric, size: int, worker_id: str) -> _Received | None:
    """A receive buffer on `fabric` for the pull, or None if it cannot have one."""
    try:
        return _Received(fabric.receive_buffer(size), fabric.name)
    except OSError as exc:
        _warn("worker %s: KV over TCP, no fabric buffer: %s", worker_id, exc)
        return None


async def pull_kv(
    client: RequestPlaneClient,
    transfer: KvTransfer,
    timeout_s: float,
    *,
    worker_id: str = "",
    fabric: KvFabric | None = None,
) -> list[bytes | memoryview]:
    """The records of `transfer`, in order, from the worker holding them: mapped from shared
    memory when it is on this host (views, no copy), else written into a buffer on `fabric`
    when the server has a fabric too (views of it), else streamed over the request plane. On a
    failure or after `timeout_s`, the records that arrived before it (cancelling the caller
    stops the pull). `worker_id` labels the metrics."""
    wanted = len(transfer.block_hashes)
    if not wanted or not transfer.address:
        return []
    max_record = min(transfer.block_bytes + RECORD_HEADER_ALLOWANCE, MAX_RECORD_BYTES)
    local = bool(transfer.host_id) and transfer.host_id == host_id()
    # The caller names the segment, so that it removes it even when the server dies between
    # creating it and telling us about it.
    segment = segment_name() if local else ""
    call = KvBlocksCall(transfer.transfer_id, host_id() if local else "", segment)
    received = None
    if fabric is not None and not local:
        capacity = wanted * max_record
        received = _offer_buffer(fabric, capacity, worker_id)
        if received is not None:
            call.fabric, call.buffer, call.capacity = fabric.session, received.buffer.address, capacity
    pull = _Pull(wanted, max_record, worker_id, segment, received)
    stream = client.stream(transfer.address, KV_BLOCKS, encode(call), KV_PULL_BACKLOG_BYTES)
    start = time.monotonic()
    complete = False  # the server finished its answer: no write of its can still be landing
    try:
        async with asyncio.timeout(timeout_s):
            async for payload in stream:
                await pull.take(payload)
        complete = True
    except (EngineError, TimeoutError, OSError, ValueError) as exc:  # ValueError: decode errors too
        _warn(
            "worker %s: KV pull of %s from %s ended with %d of %d records: %r",
            worker_id,
            transfer.transfer_id[:80],
            transfer.address,
            len(pull.records),
            wanted,
            exc,
        )
    finally:
        await stream.aclose()
        pull.close(complete)
        if segment:
            unlink_segment(segment)  # claimed already, usually: then there is nothing to remove
        got = len(pull.records)
        outcome = "ok" if got == wanted else "partial" if got else "failed"
        metrics.observe_transfer(
            worker_id, "pulled", pull.transport, outcome, pull.size, time.monotonic() - start
        )
    return pull.records
