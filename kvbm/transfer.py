"""One thread that owns the slow tiers' I/O, so a disk or a Redis never stalls an engine step.

Every read and write of the disk and remote stores runs here, one job at a time (the stores
are then used from one thread only, and a slow medium is not also hammered by concurrent
requests). The queue is bounded: a job offered while `max_pending` wait is refused, and the
caller treats that as what it is, an offload skipped or a read not tried, both of which are
misses later, never errors. That is the backpressure: a tier slower than the engine sheds
work instead of growing a queue.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class TransferEngine:
    def __init__(self, max_pending: int = 256) -> None:
        self.max_pending = max_pending
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._pending = 0
        self._count = threading.Lock()
        self._idle = threading.Condition(self._count)
        self._thread = threading.Thread(target=self._run, name="weir-kv-transfers", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue `job`; False (and nothing queued) when `max_pending` jobs already wait."""
        with self._count:
            if self._pending >= self.max_pending:
                return False
            self._pending += 1
        self._jobs.put(job)
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Until every queued job has run (tests, shutdown); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # a store bug must not end the thread: later jobs still run
                log.exception("KV transfer failed")
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
