"""A small pool of threads that owns the slow tiers' I/O, so a disk or a Redis never stalls
an engine step.

Every read and write of the disk and remote stores runs here, up to `workers` jobs at once:
a prefix load waits for one disk or Redis read at most, not for every offload queued before
it, and the disk sees several positioned reads in flight (an NVMe device is only fast at a
queue depth above one). The stores are safe to call from several threads (disk.py,
redis_store.py). The queue is bounded: a job offered while `max_pending` are queued or
running is refused, and the caller treats that as what it is, an offload skipped or a read
not tried, both of which are misses later, never errors. That is the backpressure: a tier
slower than the engine sheds work instead of growing a queue. A closed engine refuses every
job the same way.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class TransferEngine:
    def __init__(self, max_pending: int = 256, workers: int = 4) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.max_pending = max_pending
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._pending = 0  # queued or running
        self._closed = False
        self._count = threading.Lock()
        self._idle = threading.Condition(self._count)
        self._threads = [
            threading.Thread(target=self._run, name=f"weir-kv-transfers-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue `job`; False (and nothing queued) when `max_pending` jobs are already queued
        or running, or once the engine is closed."""
        with self._count:
            if self._closed or self._pending >= self.max_pending:
                return False
            self._pending += 1
        self._jobs.put(job)
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Until every queued job has run (tests, shutdown); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Run what is queued, then stop the threads."""
        with self._count:
            self._closed = True
        for _ in self._threads:  # one stop per thread, behind every job already queued
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=10)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # a store bug must not end the thread: later jobs still run
                log.exception("KV transfer failed")
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
