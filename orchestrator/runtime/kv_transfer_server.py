"""The prefill side of the KV data plane: offered transfers held with an expiry, each served
once on the `kv_blocks` endpoint (kv_transfer.py has the wire format).

The worker host offers each `KvTransfer` a prefill-only request ends with. The engine keeps
those blocks until `release_transfer`, which comes after the one pull that serves them (its
outcome whatever it is: a decode worker recomputes what did not arrive) or at the hold's
expiry, so a decode worker that never comes costs blocks for `hold_s` only. Expiries are loop
timers rather than a polling sweeper: exact, and nothing runs while nothing is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator
from typing import Protocol

import msgspec

from orchestrator.runtime import worker_metrics as metrics
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.kv_fabric import KvFabric
from orchestrator.runtime.kv_transfer import (
    FABRIC_BATCH_BYTES,
    INLINE,
    MAX_RECORD_BYTES,
    SHM_DIR,
    KvBlocksCall,
    KvPushed,
    KvShared,
    batches,
    decode_call,
    encode,
    host_id,
    in_thread_on,
    new_segment,
    unlink_segment,
    write_records,
)
from orchestrator.runtime.protocol import KvTransfer
from orchestrator.runtime.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)

DEFAULT_HOLD_S = 30.0


class TransferSource(Protocol):
    """The part of `Engine` (engine.py) that holds transfers."""

    def read_transfer(self, transfer_id: str) -> list[bytes] | None: ...

    def release_transfer(self, transfer_id: str) -> None: ...


class KvTransferServer:
    def __init__(
        self,
        engine: TransferSource,
        worker_id: str,
        hold_s: float = DEFAULT_HOLD_S,
        fabric: KvFabric | None = None,
    ) -> None:
        if hold_s <= 0:
            raise ValueError("hold_s must be positive")
        self.engine = engine
        self.worker_id = worker_id
        self.hold_s = hold_s
        self.fabric = fabric  # pushes to callers that offer a buffer on theirs (kv_fabric.py)
        self._held: dict[str, asyncio.TimerHandle] = {}
        self._segments: dict[str, asyncio.TimerHandle] = {}  # written, maybe not yet claimed
        self._warn = ThrottledWarning(log)

    def holds(self, transfer_id: str) -> bool:
        return transfer_id in self._held

    def offer(self, transfer: KvTransfer) -> None:
        """Hold `transfer` for one pull, or until `hold_s` from now."""
        tid = transfer.transfer_id
        with contextlib.suppress(KeyError):
            self._held.pop(tid).cancel()
        self._held[tid] = asyncio.get_running_loop().call_later(self.hold_s, self._expire, tid)

    def close(self) -> None:
        """Release everything held and remove unclaimed segments (the host is stopping)."""
        held, self._held = self._held, {}
        for tid, timer in held.items():
            timer.cancel()
            self.engine.release_transfer(tid)
        segments, self._segments = self._segments, {}
        for name, timer in segments.items():
            timer.cancel()
            unlink_segment(name)

    async def serve(self, payload: bytes) -> AsyncGenerator[bytes, None]:
        """The `kv_blocks` handler: the transfer's records, in order, then its release."""
        try:
            call = decode_call(payload)
        except msgspec.DecodeError as exc:
            raise EngineError("invalid_request", f"bad KvBlocksCall: {exc}") from exc
        timer = self._held.pop(call.transfer_id, None)
        if timer is None:
            raise EngineError("invalid_request", f"no KV held for transfer {call.transfer_id[:80]!r}")
        timer.cancel()
        start, sent, outcome, transport = time.monotonic(), 0, "failed", "tcp"
        try:
            records = await asyncio.to_thread(self.engine.read_transfer, call.transfer_id)
            if records is None:
                raise EngineError(
                    "internal", f"the engine no longer holds transfer {call.transfer_id[:80]!r}"
                )
            # A record no answer frame can carry would make the caller drop the whole
            # connection (other pulls on it included): serve the prefix before it.
            usable = next((i for i, r in enumerate(records) if len(r) > MAX_RECORD_BYTES), len(records))
            done = 0
            if call.host_id and call.host_id == host_id():
                async with contextlib.aclosing(self._shared(records[:usable], call.segment)) as frames:
                    async for frame, count, size in frames:
                        transport = "shm"
                        yield frame
                        done, sent = done + count, sent + size
            elif call.fabric and self.fabric is not None:
                async with contextlib.aclosing(self._pushed(records[:usable], call, self.fabric)) as frames:
                    async for frame, count, size in frames:
                        transport = self.fabric.name
                        yield frame
                        done, sent = done + count, sent + size
            if done < usable:
                yield INLINE
                for record in records[done:usable]:
                    yield record
                    sent += len(record)
            outcome = "ok" if usable == len(records) else "partial"
        finally:
            self.engine.release_transfer(call.transfer_id)
            metrics.observe_transfer(
                self.worker_id, "served", transport, outcome, sent, time.monotonic() - start
            )

    async def _shared(self, records: list[bytes], name: str) -> AsyncGenerator[tuple[bytes, int, int], None]:
        """`records` written into the new segment `name` batch by batch, each batch's `KvShared`
        frame with its record and byte counts as soon as it is written. Stops early (the rest
        goes over TCP) when /dev/shm lacks the room, the name is not ours to create, or a
        write fails."""
        total = sum(map(len, records))
        try:
            stat = os.statvfs(SHM_DIR)
            if stat.f_bavail * stat.f_frsize < total:
                raise OSError(f"{SHM_DIR} has less than {total} bytes free")
            fd = new_segment(name)
        except OSError as exc:
            self._warn("worker %s: KV over TCP, no shared-memory segment: %s", self.worker_id, exc)
            return
        self._segments[name] = asyncio.get_running_loop().call_later(self.hold_s, self._expire_segment, name)
        offset = 0
        try:
            for group in batches(records):
                size = sum(map(len, group))
                await in_thread_on(fd, write_records, group, offset)
                yield encode(KvShared(name, offset, [len(r) for r in group])), len(group), size
                offset += size
        except OSError as exc:
            self._warn("worker %s: KV segment write failed, the rest over TCP: %s", self.worker_id, exc)
        finally:
            os.close(fd)

    async def _pushed(
        self, records: list[bytes], call: KvBlocksCall, fabric: KvFabric
    ) -> AsyncGenerator[tuple[bytes, int, int], None]:
        """`records` written through `fabric` into the caller's buffer batch by batch, each
        batch's `KvPushed` frame with its record and byte counts once the batch has landed.
        Stops early (the rest goes over TCP) at the end of the buffer or when a write fails."""
        offset = 0
        for group in batches(records, FABRIC_BATCH_BYTES):
            size = sum(map(len, group))
            if offset + size > call.capacity:
                return
            try:
                await asyncio.to_thread(fabric.write, call.fabric, group, call.buffer + offset)
            except OSError as exc:
                self._warn("worker %s: KV fabric write failed, the rest over TCP: %s", self.worker_id, exc)
                return
            yield encode(KvPushed(offset, [len(r) for r in group])), len(group), size
            offset += size

    def _expire(self, transfer_id: str) -> None:
        if self._held.pop(transfer_id, None) is not None:
            self.engine.release_transfer(transfer_id)
            metrics.KV_TRANSFERS.labels(self.worker_id, "served", "expired").inc()

    def _expire_segment(self, name: str) -> None:
        del self._segments[name]
        if unlink_segment(name):
            log.debug("worker %s: removed KV segment %s, never claimed", self.worker_id, name)
