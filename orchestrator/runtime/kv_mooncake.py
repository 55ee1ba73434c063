"""`KvFabric` over Mooncake's TransferEngine (`pip install 'weir[mooncake]'`), the transfer
engine SGLang's and vLLM's disaggregation use, over its TCP transport.

Each process runs one engine in Mooncake's peer-to-peer handshake mode: no metadata server,
a peer is named by its host and the engine's RPC port. A write registers the records' own
memory for the length of the write (no staging copy; a refcount per address, since two
transfers may share a record); a receive buffer is registered until its pull ends. Its
throughput against our own TCP stream is in `benchmarks/kv_transfer.py`.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, deque

import numpy as np

# A write that a cancelled pull gave up on may still be landing in its buffer: the memory is
# kept this long after the buffer stops accepting writes. A server's write stops when its
# connection does; this bounds one that has not noticed yet.
QUARANTINE_S = 60.0


class _Buffer:
    def __init__(self, fabric: MooncakeFabric, size: int) -> None:
        self._fabric = fabric
        self._memory = np.empty(size, dtype=np.uint8)
        self.address = int(self._memory.ctypes.data)
        self.view = self._memory.data
        if fabric.engine.register_memory(self.address, size) != 0:
            raise OSError(f"Mooncake could not register a {size}-byte receive buffer")
        self._open = True

    def close(self, complete: bool) -> None:
        if not self._open:
            return
        self._open = False
        self._fabric.engine.unregister_memory(self.address)
        if not complete:
            self._fabric.quarantine(self._memory)


class MooncakeFabric:
    name = "mooncake"

    def __init__(self, hostname: str) -> None:
        # Its INFO and WARNING lines (per connection and segment) off unless asked for.
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ValueError(
                "--kv-transport mooncake needs Mooncake's transfer engine: "
                f"pip install 'weir[mooncake]' ({exc})"
            ) from exc
        self.engine = TransferEngine()
        if self.engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "") != 0:
            raise OSError(f"Mooncake's transfer engine did not start on {hostname}")
        self.session = f"{self.name}:{hostname}:{self.engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._registered: Counter[int] = Counter()  # address -> writes using its registration
        self._quarantined: deque[tuple[float, np.ndarray]] = deque()

    def receive_buffer(self, size: int) -> _Buffer:
        self._expire_quarantine()
        return _Buffer(self, size)

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
