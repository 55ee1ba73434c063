"""`KvFabric` over Mooncake's TransferEngine (`pip install 'weir[mooncake]'`), the transfer
engine SGLang's and vLLM's disaggregation use, over its TCP transport.

Each process runs one engine in Mooncake's peer-to-peer handshake mode: no metadata server,
a peer is named by its host and the engine's RPC port. A write registers the records' own
memory for the length of the write (no staging copy; a refcount per address, since two
transfers may share a record). Receive buffers are pieces of one arena registered once at
start, as transfer engines expect (RDMA pins what it registers, which costs per call): a
piece goes back to the arena when the last view of the records in it does, so pulls reuse
memory whose pages are already there. A pull the arena has no room for gets memory of its
own, registered for that pull. Throughput against our own TCP stream is in
`benchmarks/kv_transfer.py --fabric mooncake`.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
import weakref
from collections import Counter, deque
from typing import Any

import numpy as np

# A write that a cancelled pull gave up on may still be landing in its buffer: the memory is
# kept this long after the buffer stops accepting writes. A server's write stops when its
# connection does; this bounds one that has not noticed yet.
QUARANTINE_S = 60.0
# Receive memory registered once, shared by the pulls in flight and the records they left
# (until the engine has loaded them): the KV of 2,048 tokens of Llama-3-8B in bf16 (128 KiB a
# token), or of about 5,800 of SmolLM2 in float32 (45 KiB a token).
DEFAULT_ARENA_BYTES = 256 * 1024 * 1024
_ALIGN = 4096


class _Arena:
    """One registered region handed out in pieces (first fit, neighbours merged on return)."""

    def __init__(self, memory: np.ndarray) -> None:
        self.memory = memory
        self.address = int(memory.ctypes.data)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, memory.size)]  # (offset, size), by offset
        # Pieces come back from whichever thread drops their last view, garbage collection
        # included, which may run inside `take` itself: a finalizer only queues the piece
        # (deque.append is atomic), and the next `take` merges it in under the lock.
        self._returned: deque[tuple[int, int]] = deque()

    def take(self, size: int) -> np.ndarray | None:
        size = -(-size // _ALIGN) * _ALIGN
        with self._lock:
            self._merge_returned()
            for i, (offset, room) in enumerate(self._free):
                if room >= size:
                    self._free[i : i + 1] = [(offset + size, room - size)] if room > size else []
                    break
            else:
                return None
        piece = self.memory[offset : offset + size]
        weakref.finalize(piece, self._returned.append, (offset, size))
        return piece

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._merge_returned()
            return sum(size for _, size in self._free)

    def _merge_returned(self) -> None:
        while self._returned:
            offset, size = self._returned.popleft()
            i = bisect.bisect(self._free, (offset, size))
            self._free.insert(i, (offset, size))
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
                size += self._free.pop(i + 1)[1]
                self._free[i] = (offset, size)
            if i and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                previous = self._free.pop(i - 1)
                self._free[i - 1] = (previous[0], previous[1] + size)


class _Buffer:
    def __init__(self, fabric: MooncakeFabric, memory: np.ndarray, registered: bool) -> None:
        self._fabric = fabric
        self._memory: np.ndarray | None = memory
        self._registered = registered  # memory of its own, registered for this pull
        self.address = int(memory.ctypes.data)
        self.view = memory.data

    def close(self, complete: bool) -> None:
        memory, self._memory = self._memory, None
        if memory is None:
            return
        if self._registered:
            self._fabric.engine.unregister_memory(self.address)
        if not complete:
            self._fabric.quarantine(memory)


class MooncakeFabric:
    name = "mooncake"

    def __init__(self, hostname: str, arena_bytes: int = DEFAULT_ARENA_BYTES) -> None:
        # Its INFO and WARNING lines (per connection and segment) off unless asked for.
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ValueError(
                "--kv-transport mooncake needs Mooncake's transfer engine: "
                f"pip install 'weir[mooncake]' ({exc})"
            ) from exc
        self.engine: Any = TransferEngine()
        if self.engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "") != 0:
            raise OSError(f"Mooncake's transfer engine did not start on {hostname}")
        self.session = f"{self.name}:{hostname}:{self.engine.get_rpc_port()}"
        # Pages are touched on first use, not here: an idle worker holds no more than it used.
        self.arena = _Arena(np.empty(arena_bytes, dtype=np.uint8))
        if self.engine.register_memory(self.arena.address, arena_bytes) != 0:
            raise OSError(f"Mooncake could not register {arena_bytes} bytes of receive memory")
        self._lock = threading.Lock()
        self._registered: Counter[int] = Counter()  # address -> writes using its registration
        self._quarantined: deque[tuple[float, np.ndarray]] = deque()

    def receive_buffer(self, size: int) -> _Buffer:
        self._expire_quarantine()
        piece = self.arena.take(size)
        if piece is not None:
            return _Buffer(self, piece, registered=False)
        memory = np.empty(size, dtype=np.uint8)
        if self.engine.register_memory(int(memory.ctypes.data), size) != 0:
            raise OSError(f"Mooncake could not register a {size}-byte receive buffer")
        return _Buffer(self, memory, registered=True)

    def write(self, session: str, records: list[bytes], address: int) -> None:
        prefix = f"{self.name}:"
        if not session.startswith(prefix):
            raise OSError(f"not a Mooncake session: {session[:80]!r}")
        target = session[len(prefix) :]
        sources = [int(np.frombuffer(record, dtype=np.uint8).ctypes.data) for record in records]
        sizes = [len(record) for record in records]
        targets = [address + offset for offset in np.cumsum([0, *sizes[:-1]]).tolist()]
        self._register(sources, sizes)
        try:
            if self.engine.batch_transfer_sync_write(target, sources, targets, sizes) != 0:
                raise OSError(f"Mooncake's write of {len(records)} KV records to {target} failed")
        finally:
            self._unregister(sources)

    def quarantine(self, memory: np.ndarray) -> None:
        with self._lock:
            self._quarantined.append((time.monotonic() + QUARANTINE_S, memory))

    def close(self) -> None:
        # The engine's threads and port go with the process: the binding has no shutdown call.
        with self._lock:
            self._quarantined.clear()

    def _expire_quarantine(self) -> None:
        now = time.monotonic()
        with self._lock:
            while self._quarantined and self._quarantined[0][0] <= now:
                self._quarantined.popleft()

    def _register(self, addresses: list[int], sizes: list[int]) -> None:
        with self._lock:
            new = {a: s for a, s in zip(addresses, sizes, strict=True) if not self._registered[a]}
            if new and self.engine.batch_register_memory(list(new), list(new.values())) != 0:
                raise OSError("Mooncake could not register KV records for a write")
            self._registered.update(addresses)

    def _unregister(self, addresses: list[int]) -> None:
        with self._lock:
            self._registered.subtract(addresses)
            done = [a for a in set(addresses) if self._registered[a] <= 0]
            for address in done:
                del self._registered[address]
            if done:
                self.engine.batch_unregister_memory(done)
